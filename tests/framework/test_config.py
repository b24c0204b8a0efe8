"""Typed configs: YAML + overrides, and one clear error per mistake."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from phalanx.config import ConfigError, load_config


@dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class Recipe:
    name: str = "run"
    steps: int = 10
    plugin: Literal["ddp", "fsdp", "zero1", "zero2"] = "ddp"
    bf16: bool = False
    data_path: Optional[str] = None
    optim: Optim = field(default_factory=Optim)


def test_yaml_and_overrides(tmp_path):
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text("name: demo\nsteps: 5\noptim:\n  lr: 3.0e-4\n")
    cfg = load_config(Recipe, cfg_file, ["steps=7", "optim.lr=1e-2", "bf16=true", "plugin=zero2",
                                         "optim.betas=[0.8,0.9]", "data_path=none"])
    assert (cfg.name, cfg.steps, cfg.optim.lr, cfg.bf16, cfg.plugin) == ("demo", 7, 1e-2, True, "zero2")
    assert cfg.optim.betas == [0.8, 0.9] and cfg.data_path is None


@pytest.mark.parametrize("overrides, message", [
    (["stesp=3"], "unknown config key 'stesp'. Did you mean 'steps'?"),
    (["optim.lrr=3"], "unknown config key 'optim.lrr'"),
    (["steps=three"], "config key 'steps': 'three' is not an int"),
    (["plugin=zero3"], "is not one of 'ddp', 'fsdp', 'zero1', 'zero2'"),
    (["bf16=maybe"], "is not a bool"),
    (["steps"], "must look like key=value"),
])
def test_bad_overrides_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(Recipe, None, overrides)
    assert message in str(info.value)
    if "unknown" in message:
        assert "Valid keys here:" in str(info.value)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Recipe, tmp_path / "nope.yaml")
