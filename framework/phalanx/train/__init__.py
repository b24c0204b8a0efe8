"""The one training loop every Phalanx app uses.

    from phalanx.train import TrainConfig, fit, TrainResult
    result = fit(TrainConfig(output_dir="runs/x", max_steps=100, plugin="zero2", precision="bf16"),
                 model, train_dataset, eval_fn=causal_lm_eval(val_dataset))

Apps supply the model, the data, the loss (optional: causal LMs get a fused LM-head loss) and
the config; the loop brings accumulation, clipping, the LR schedule, eval, checkpoints, exact
resume, logging, metrics, wandb, throughput/MFU and the loss plot. See docs/training.md.
"""
from phalanx.train.config import TrainConfig
from phalanx.train.data import default_collate
from phalanx.train.ema import EMA
from phalanx.train.evaluate import causal_lm_eval, data_replica, eval_loss_sum
from phalanx.train.losses import CausalLMLoss
from phalanx.train.loop import NonFiniteLossError, TrainHook, fit
from phalanx.train.optim import build_lr_scheduler, build_optimizer, warmup_cosine
from phalanx.train.result import TrainResult
from phalanx.train.run import TrainingRun

__all__ = ["TrainConfig", "fit", "TrainingRun", "TrainResult", "CausalLMLoss", "causal_lm_eval", "eval_loss_sum", "data_replica",
           "default_collate",
           "NonFiniteLossError", "TrainHook", "EMA", "build_optimizer", "build_lr_scheduler", "warmup_cosine"]
