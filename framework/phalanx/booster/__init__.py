"""`Booster` and its plugins."""
from phalanx.booster.booster import Booster
from phalanx.booster.wrappers import ModelWrapper

__all__ = ["Booster", "ModelWrapper"]
