"""`Booster` and its plugins."""
from phalanx.booster.booster import Booster
from phalanx.booster.plugins.base import unwrap_model
from phalanx.booster.wrappers import ModelWrapper

__all__ = ["Booster", "ModelWrapper", "unwrap_model"]
