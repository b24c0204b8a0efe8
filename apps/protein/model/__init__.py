"""The AlphaFold 2 network: embedders, Evoformer, extra-MSA stack, structure module, heads."""
from apps.protein.model.alphafold import AlphaFold, ModelConfig

__all__ = ["AlphaFold", "ModelConfig"]
