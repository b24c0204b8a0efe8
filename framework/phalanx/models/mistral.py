"""Mistral: Llama's layout with a sliding window on every layer (when sliding_window is set)."""
import dataclasses

from phalanx.models import llama
from phalanx.models.family import Family, heads_reader


def read(config) -> dict:
    return llama.read_llama_like(config, windows="all")


POLICY = dataclasses.replace(llama.POLICY, family="mistral", model_types=("mistral",), heads=heads_reader(read))
FAMILY = Family("mistral", ("mistral",), read, llama.NAMES, POLICY, required=llama.REQUIRED,
                check_inference=llama.check_llama_like)
