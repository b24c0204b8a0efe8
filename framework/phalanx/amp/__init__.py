"""Mixed precision: dtype policy, dynamic loss scaling, and gradient clipping over shards."""
from phalanx.amp.precision import PRECISIONS, dtype_of, check_precision, resolve_precision
from phalanx.amp.loss_scaler import DynamicLossScaler
from phalanx.amp.clip import global_grad_norm, clip_grads_by_norm
from phalanx.amp.mixed_precision_optimizer import MixedPrecisionOptimizer

__all__ = ["PRECISIONS", "dtype_of", "check_precision", "resolve_precision", "DynamicLossScaler", "global_grad_norm",
           "clip_grads_by_norm", "MixedPrecisionOptimizer"]
