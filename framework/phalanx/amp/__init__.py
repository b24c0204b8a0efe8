"""Mixed precision: the typed precision, dynamic loss scaling, and gradient clipping over shards."""
from phalanx.amp.precision import BF16, CHOICES, FP8, FP16, FP32, PRECISIONS, Precision, resolve_precision
from phalanx.amp.loss_scaler import DynamicLossScaler
from phalanx.amp.clip import global_grad_norm, clip_grads_by_norm
from phalanx.amp.mixed_precision_optimizer import MixedPrecisionOptimizer

__all__ = ["Precision", "FP32", "BF16", "FP16", "FP8", "PRECISIONS", "CHOICES", "resolve_precision", "DynamicLossScaler",
           "global_grad_norm", "clip_grads_by_norm", "MixedPrecisionOptimizer"]
