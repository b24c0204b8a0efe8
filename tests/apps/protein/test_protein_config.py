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


def test_dap_groups_are_ddps_data_replicas():
    from apps.protein.train import with_dap_replicas

    cfg = load_recipe("apps/protein/configs/tiny.yaml", ["dap_size=2", "train.plugin_options={bucket_cap_mb: 5}"])
    assert with_dap_replicas(cfg).plugin_options == {"bucket_cap_mb": 5, "ranks_per_replica": 2}
    assert with_dap_replicas(load_recipe("apps/protein/configs/tiny.yaml")).plugin_options == {}
    with pytest.raises(ConfigError, match="'dap_size'=2 runs under train.plugin = ddp .*got train.plugin='zero2'"):
        with_dap_replicas(load_recipe("apps/protein/configs/tiny.yaml", ["dap_size=2", "train.plugin=zero2"]))


def test_the_fine_tuning_configs_are_alphafolds_second_stage():
    """alphafold2_finetune.yaml: supplement table 4's fine-tuning (crop 384, 512 MSA clusters, 5,120
    extra sequences, lr 5e-4 constant without warm-up, ~1.5 M samples) and its loss terms (violation
    1.0, experimentally resolved 0.01, PAE 0.1), starting from alphafold2.yaml's output with the same
    model; tiny_finetune.yaml the same stage from tiny.yaml's run (its model plus the PAE head)."""
    from dataclasses import asdict

    full = load_recipe("apps/protein/configs/alphafold2.yaml")
    ft = load_recipe("apps/protein/configs/alphafold2_finetune.yaml")
    assert (ft.data.crop_size, ft.data.max_msa_clusters, ft.data.max_extra_msa, ft.data.max_templates) == (384, 512, 5120, 4)
    assert (ft.loss.violation, ft.loss.experimentally_resolved, ft.loss.pae) == (1.0, 0.01, 0.1)
    assert (full.loss.violation, full.loss.experimentally_resolved, full.loss.pae) == (0.0, 0.0, 0.0)
    assert (ft.train.lr, ft.train.warmup_steps, ft.train.min_lr_ratio) == (5e-4, 0, 1.0) and full.train.lr == 1e-3
    assert ft.train.max_steps * 128 == pytest.approx(1.5e6, rel=0.01)
    assert asdict(ft.model) == asdict(full.model) and ft.model.pae_head
    assert ft.init_from == full.train.output_dir and ft.train.output_dir != full.train.output_dir
    assert (ft.loss.fape_clamp, ft.loss.masked_msa, ft.ema.decay) == (10.0, 2.0, 0.999)

    tiny, tiny_ft = load_recipe("apps/protein/configs/tiny.yaml"), load_recipe("apps/protein/configs/tiny_finetune.yaml")
    assert tiny_ft.init_from == tiny.train.output_dir
    assert asdict(tiny_ft.model) == asdict(tiny.model) | {"pae_head": True}
    assert (tiny_ft.loss.violation, tiny_ft.loss.experimentally_resolved, tiny_ft.loss.pae) == (1.0, 0.01, 0.1)
    assert tiny_ft.train.lr == tiny.train.lr / 2 and tiny_ft.train.min_lr_ratio == 1.0


def test_init_from_loads_the_trained_weights(tmp_path):
    """init_from: a missing path stops before any work with the key and the fix; a run's trained
    weights (not its EMA average) load into the fine-tuning model exactly, the PAE head it lacks
    keeping its initialisation; a model of another size stops with the config to fix."""
    import torch
    from safetensors.torch import save_file

    from apps.protein.model import AlphaFold
    from apps.protein.train import initial_weights, load_initial_weights

    cfg = load_recipe("apps/protein/configs/tiny_finetune.yaml", [f"init_from={tmp_path / 'nothing'}",
                                                                   f"train.output_dir={tmp_path / 'ft'}"])
    with pytest.raises(FileNotFoundError, match="init_from=.*nothing.*output_dir"):
        initial_weights(cfg)
    torch.manual_seed(5)
    trained = AlphaFold(load_recipe("apps/protein/configs/tiny.yaml").model)
    step = tmp_path / "run" / "checkpoints" / "step-00000003"
    (step / "model").mkdir(parents=True)
    (step / "ema").mkdir()
    save_file(trained.state_dict(), str(step / "model" / "model.safetensors"))
    save_file({k: v + 1 for k, v in trained.state_dict().items()}, str(step / "ema" / "ema.safetensors"))
    cfg = load_recipe("apps/protein/configs/tiny_finetune.yaml", [f"init_from={step}", f"train.output_dir={tmp_path / 'ft'}"])
    assert initial_weights(cfg) == step
    torch.manual_seed(0)
    model = AlphaFold(cfg.model)
    pae_before = model.heads.pae.weight.detach().clone()
    load_initial_weights(model, initial_weights(cfg))
    for name, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model.heads.pae.weight, pae_before)
    other = load_recipe("apps/protein/configs/tiny_finetune.yaml", [f"init_from={step}", "model.c_z=8"])
    with pytest.raises(ValueError, match="does not fit the model"):
        load_initial_weights(AlphaFold(other.model), step)
