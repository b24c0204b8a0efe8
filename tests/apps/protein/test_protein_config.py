"""The recipe configs load and validate; impossible values stop with the key to fix."""
from __future__ import annotations

import pytest

from apps.protein.config import load_recipe
from phalanx.config import ConfigError


def test_shipped_configs_load():
    tiny = load_recipe("apps/protein/configs/tiny.yaml")
    assert tiny.model.evoformer.c_m == tiny.model.c_m == 32 and tiny.train.precision == "fp32"  # bf16 not supported by the model yet (README)
    full = load_recipe("apps/protein/configs/alphafold2.yaml")
    assert full.model.evoformer_blocks == 48 and full.model.structure.c_s == 384


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="data.crop_size.*multiple of dap_size=4"):
        load_recipe("apps/protein/configs/tiny.yaml", ["dap_size=4", "data.crop_size=30"])
    with pytest.raises(ConfigError, match="model.recycles"):
        load_recipe("apps/protein/configs/tiny.yaml", ["model.recycles=-1"])
    with pytest.raises(ConfigError):
        load_recipe("apps/protein/configs/tiny.yaml", ["model.evoformer.no_such_key=1"])
