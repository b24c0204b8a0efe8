"""PPO's rollout buffer (everything the mini-batch epochs reuse), its columns, and
PPO's prompt loading (`data.max_prompt_tokens`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from phalanx.config import ConfigError

from .data import drop_long_prompts
from .ppo_model import HIDDEN_KEYS
from .rl_rollouts import DataSettings, encode_prompts, load_prompt_sets

TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids", "completion_mask")
PER_TOKEN_KEYS = ("old_logp", "old_values", "advantages", "returns")
OPTIONAL_KEYS = ("tis",)  # [B, T] truncated importance weights trainer / engine (ppo.tis_cap; None: off)
WIDE_KEYS = ("input_ids", "attention_mask", "position_ids") + HIDDEN_KEYS  # prompt + completion columns


@dataclass
class RolloutBuffer:
    """This rank's rollout, with everything PPO's mini-batch epochs reuse, computed once at rollout
    time: the token batch ([B, P+T] prompts left-padded, completions right-padded, `completion_mask`
    [B, T]) and per-token [B, T] old_logp (the trainer's, from the weights that sampled), old_values
    (the critic's), advantages (GAE, whitened) and returns. `step`: the optimizer step that made it.

    old_logp is the trainer's forward, not the engine's log-probs: the two agree to the guard's gap
    in fp32, but under bf16 training the trainer rounds differently from the fp32 engine, and the
    ratio of the first mini-batch must be 1 for the clip to measure the policy's change only."""

    step: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_mask: torch.Tensor
    old_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    actor_hidden: torch.Tensor | None = None
    critic_hidden: torch.Tensor | None = None
    tis: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def keys(self) -> tuple[str, ...]:
        return TOKEN_KEYS + PER_TOKEN_KEYS + tuple(k for k in HIDDEN_KEYS + OPTIONAL_KEYS
                                                   if getattr(self, k) is not None)

    def rows(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows `index`, without the columns that are padding in all of them."""
        return trim_columns({k: getattr(self, k)[index] for k in self.keys()})

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file
        save_file({k: getattr(self, k).contiguous().cpu() for k in self.keys()}, str(path),
                  metadata={"step": str(self.step)})

    @classmethod
    def load(cls, path: Path, device: torch.device | str = "cpu") -> "RolloutBuffer":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            step = int(f.metadata()["step"])
            tensors = {k: f.get_tensor(k) for k in TOKEN_KEYS + PER_TOKEN_KEYS + HIDDEN_KEYS + OPTIONAL_KEYS
                       if k in f.keys()}
        return cls(step=step, **tensors)


def column_window(batch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(start, stop, kept completion columns): the prompt + completion columns some row uses."""
    T = batch["completion_mask"].shape[1]
    P = batch["input_ids"].shape[1] - T
    keep_t = max(int(batch["completion_mask"].sum(1).max()), 1)
    return P - int(batch["attention_mask"][:, :P].sum(1).max()), P + keep_t, keep_t


def trim_columns(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the leading prompt columns and trailing completion columns that no row uses (a
    mini-batch of short sequences should not pay for the rollout's longest one)."""
    start, stop, keep_t = column_window(batch)
    return {k: v[:, start:stop] if k in WIDE_KEYS else v[:, :keep_t] for k, v in batch.items()}


@dataclass
class PPODataSettings(DataSettings):
    max_prompt_tokens: int = 0        # drop prompts longer than this many tokens at load time (0: keep all)



def load_ppo_prompts(data: PPODataSettings, tokenizer, log=None
                     ) -> tuple[list[dict], list[dict], list[list[int]], list[list[int]]]:
    """(train records, held-out records, their token ids). With data.max_prompt_tokens the longer
    prompts are dropped first and num_train / num_heldout then count the prompts that remain (a
    one-file preference source still holds out the last num_heldout of the first num_train +
    num_heldout)."""
    from .tasks import TASKS
    if not data.max_prompt_tokens:
        train, held = load_prompt_sets(data)
        return train, held, encode_prompts(tokenizer, train), encode_prompts(tokenizer, held)
    one_file_split = data.source not in TASKS and not data.heldout and data.kind == "preference" and data.num_heldout
    train, held = load_prompt_sets(data if data.source in TASKS else replace(data, num_train=0, num_heldout=0))
    train, train_ids, dropped_train = drop_long_prompts(train, encode_prompts(tokenizer, train), data.max_prompt_tokens)
    held, held_ids, dropped_held = drop_long_prompts(held, encode_prompts(tokenizer, held), data.max_prompt_tokens)
    read = len(train) + dropped_train + len(held) + dropped_held
    if one_file_split:
        n = data.num_train + data.num_heldout if data.num_train else len(train)
        train, train_ids = train[:n], train_ids[:n]
        if len(train) <= data.num_heldout:
            raise ConfigError(f"data.max_prompt_tokens={data.max_prompt_tokens} leaves {len(train)} prompts of "
                              f"{data.source}, not more than data.num_heldout={data.num_heldout}: raise "
                              "max_prompt_tokens or lower num_heldout")
        train, held, train_ids, held_ids = (train[:-data.num_heldout], train[-data.num_heldout:],
                                            train_ids[:-data.num_heldout], train_ids[-data.num_heldout:])
    elif data.source not in TASKS:
        if data.num_train:
            train, train_ids = train[:data.num_train], train_ids[:data.num_train]
        if data.num_heldout:
            held, held_ids = held[:data.num_heldout], held_ids[:data.num_heldout]
    if not train:
        raise ConfigError(f"data.max_prompt_tokens={data.max_prompt_tokens} drops every training prompt of "
                          f"{data.source}: raise it")
    if log is not None:
        log.info(f"data.max_prompt_tokens={data.max_prompt_tokens}: dropped {dropped_train + dropped_held} of {read} "
                 f"prompts read; {len(train)} training and {len(held)} held-out prompts remain")
    return train, held, train_ids, held_ids
