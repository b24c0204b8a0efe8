"""`Family`: everything the framework knows about one model family, in one value. A family file
(`phalanx.models.llama`, ...) builds one; `phalanx.models.registry` lists them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from phalanx.models.heads import HeadCounts
from phalanx.models.names import NameTable
from phalanx.models.policy import Policy


def _accept(config) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """name: the family ("llama"); model_types: the `config.model_type` values it reads.
    read(config) -> the `ModelSpec` fields of an HF config object (all but family, vocab_size,
    tie_word_embeddings, name and config). tied_default: tie_word_embeddings when the config does
    not say. required: keys a bare config dict must name (the planner reads config.json files;
    a missing size would otherwise be a silent class default; "a|b": either name).
    check_inference(config): raise ValueError for variants the inference engine does not run
    (transformers does). names: the checkpoint weight-name table. policy: the tensor-parallel
    shard policy."""

    name: str
    model_types: tuple[str, ...]
    read: Callable[[object], dict]
    names: NameTable
    policy: Policy
    tied_default: bool = False
    required: tuple[str, ...] = ()
    check_inference: Callable[[object], None] = _accept


def heads_reader(read: Callable[[object], dict]) -> Callable[[object], HeadCounts]:
    """A shard policy's `heads(config)`, through the family's own config reader."""
    def heads(config) -> HeadCounts:
        fields = read(config)
        return HeadCounts(fields["num_heads"], fields["num_kv_heads"], fields["head_dim"])
    return heads
