"""Shared pieces of the protein tests: a tiny model config, a real cropped batch, and the rank
function of the DAP equivalence test (importable, so spawned ranks can run it)."""
from __future__ import annotations

import numpy as np
import torch

from apps.protein.data_sets import msa_path, structure_path
from apps.protein.features import FeatureConfig, crop_window, make_features
from apps.protein.io import read_msa, read_structure
from apps.protein.model import AlphaFold, ModelConfig
from apps.protein.model.evoformer import EvoformerConfig
from apps.protein.model.structure import StructureConfig


def tiny_model_config(dropout: bool = False, **overrides) -> ModelConfig:
    """dropout: AlphaFold's rates (the config defaults); off by default, so a training-mode forward
    is deterministic for the equivalence tests."""
    rates = {} if dropout else {"dropout_msa_row": 0.0, "dropout_pair": 0.0}
    cfg = ModelConfig(c_m=16, c_z=8, c_e=8, c_s=16, evoformer_blocks=1, extra_msa_blocks=1, recycles=1,
                      evoformer=EvoformerConfig(heads_msa=2, c_hidden_msa=4, heads_pair=2, c_hidden_pair=4,
                                                c_hidden_mul=8, c_hidden_opm=4, transition_n=2, **rates),
                      structure=StructureConfig(c_ipa=4, heads=2, query_points=2, value_points=2, layers=2,
                                                c_resnet=8, **({} if dropout else {"dropout": 0.0})))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg.synced()


def tiny_model(seed: int = 0, dropout: bool = False, **overrides) -> AlphaFold:
    torch.manual_seed(seed)
    model = AlphaFold(tiny_model_config(dropout, **overrides))
    # Break the zero initialisation of the output layers, so every parameter gets a gradient
    # and every branch contributes to the output (a fresh model's residual branches are all 0).
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def real_batch(crop: int = 16, clusters: int = 4, extra: int = 4, batch: int = 2, seed: int = 0,
               templates: int = 0):
    """A batch of `batch` crops of 2q2k chain A with its real Stockholm MSA; with `templates` > 0
    also template inputs in that many slots, the chain itself (aligned residue to residue) in the first."""
    from apps.protein.templates import self_template

    chain = read_structure(structure_path("2q2k"), "A")
    alignment = read_msa(msa_path("2q2k_A/uniref90_hits.sto"))
    cfg = FeatureConfig(crop_size=crop, max_msa_clusters=clusters, max_extra_msa=extra, max_templates=max(templates, 1))
    samples = []
    for i in range(batch):
        rng = np.random.default_rng(seed + i)
        samples.append(make_features(chain, alignment, cfg, rng, crop_window(chain, crop, rng),
                                     templates=[self_template(chain)] if templates else None))
    from phalanx.train.data import default_collate
    return default_collate(samples)


def loss_and_outputs(model, batch):
    from apps.protein.losses import LossWeights, alphafold_loss

    out = model(**batch, recycles=1)
    tables = {"default_frames": model.default_frames, "atom14_local": model.atom14_local}
    loss, _ = alphafold_loss(out, batch, tables, LossWeights(experimentally_resolved=0.01))  # every head trains
    return loss, out


def dap_ranks(crop: int, clusters: int, extra: int, dap_chunk: int | None = None, dropout: bool = False,
              templates: int = 0) -> dict:
    """On every rank: the one-process result, then the same model under DAP over all ranks (its
    Evoformer blocks chunked `dap_chunk` rows at a time when given; with AlphaFold's dropout when
    `dropout`, both runs starting from the same random state). Returns both (loss, outputs,
    averaged gradients) for the test to compare."""
    import torch.distributed as dist

    from apps.protein.model.dap import Axial, DapAxial

    batch = real_batch(crop, clusters, extra, templates=templates)
    results = {}
    for name, axial in (("one", Axial()), ("dap", DapAxial())):
        extra_cfg = {}
        if templates:
            from apps.protein.model.template import TemplateConfig
            extra_cfg = {"templates": True, "template": TemplateConfig(c_t=8, blocks=1, heads=2, c_hidden_mul=8)}
        model = tiny_model(dropout=dropout, **extra_cfg).use_axial(axial)  # seeds torch: both runs draw the same masks
        if name == "dap" and dap_chunk is not None:
            for block in model.modules():
                if hasattr(block, "chunk_size"):
                    block.chunk_size = dap_chunk
        loss, out = loss_and_outputs(model, batch)
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.detach().clone()
            if name == "dap":  # what DDP does over the DAP group
                dist.all_reduce(g)
                g /= dist.get_world_size()
            grads[n] = g
        results[name] = {"loss": loss.detach(), "atom37": out["atom37"].detach(), "pair": out["pair"].detach(),
                         "msa_logits": out["masked_msa_logits"].detach(), "grads": grads}
    return results


def predict_dap_ranks(length: int, chunk: int | None, precision: str = "fp32") -> dict:
    """On every rank: `predict` of a `length`-residue sequence (with its real MSA rows when the
    sequence is 2q2k A's) in one process, then under DAP over all ranks with the Evoformer chunked
    `chunk` rows at a time (residues padded to a multiple of the ranks). Returns both predictions."""
    from apps.protein.config import load_recipe
    from apps.protein.data_sets import msa_path
    from apps.protein.model.dap import Axial, DapAxial
    from apps.protein.predict import predict

    overrides = ["model.c_m=16", "model.c_z=8", "model.c_e=8", "model.c_s=16", "model.evoformer_blocks=1",
                 "model.extra_msa_blocks=1", "model.pae_head=true", "data.max_msa_clusters=4", "data.max_extra_msa=4",
                 f"train.precision={precision}"]
    cfg = load_recipe("apps/protein/configs/tiny.yaml", overrides)
    chain = read_structure(structure_path("2q2k"), "A")
    sequence = chain.sequence[:length]
    msa = None
    if length == len(chain.sequence):
        msa = str(msa_path("2q2k_A/uniref90_hits.sto"))
    results = {}
    for name, axial in (("one", Axial()), ("dap", DapAxial())):
        torch.manual_seed(0)
        model = AlphaFold(cfg.model)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if name == "dap":
            for block in model.modules():
                if hasattr(block, "chunk_size"):
                    block.chunk_size = chunk
        model.eval().use_axial(axial)
        results[name] = predict(model, cfg, "query", sequence, msa, 1)
    return results


# tiny.yaml with the template stack at toy sizes (test_protein_templates.py)
TEMPLATE_OVERRIDES = ["model.templates=true", "model.template.c_t=8", "model.template.blocks=1",
                      "model.template.heads=2", "model.template.c_hidden_mul=8", "model.evoformer_blocks=1",
                      "model.structure.layers=2", "data.max_templates=2", "data.crop_size=16",
                      "data.max_msa_clusters=4", "data.max_extra_msa=4"]


def train_templates_rank(output_dir: str, templates_from: str = "self"):
    """Rank body: tiny.yaml with templates (each crop its own structure as template, or with
    templates_from="search" the shipped structures released before the chain's), 3 steps through
    fit, a checkpoint and an eval at the end. Returns (losses, last eval)."""
    from apps.protein.config import load_recipe
    from apps.protein.train import train

    cfg = load_recipe("apps/protein/configs/tiny.yaml", [
        *TEMPLATE_OVERRIDES, f"data.templates_from={templates_from}", "max_train_chains=2", "eval_heldout=false", "train.micro_batch_size=2",
        "train.max_steps=3", "train.eval_every=3", "train.save_every=3", "train.log_every=1",
        "train.progress_bar=false", "train.plot=false", f"train.output_dir={output_dir}"])
    result, _ = train(cfg)
    return result.losses, result.last_eval


def finetune_rank(root: str) -> dict:
    """Rank body: tiny.yaml trains 3 steps (seed 1), then tiny_finetune.yaml fine-tunes it 3 steps
    from that run (init_from; its own seed 0 and a PAE head tiny.yaml lacks). Returns the fine-tuning
    losses and eval, and both runs' final trained weights."""
    from safetensors.torch import load_file

    from apps.protein.config import load_recipe
    from apps.protein.predict import latest_weights
    from apps.protein.train import train

    small = ["max_train_chains=2", "eval_heldout=false", "train.micro_batch_size=2", "data.crop_size=16",
             "data.max_msa_clusters=4", "data.max_extra_msa=4", "train.max_steps=3", "train.eval_every=3",
             "train.save_every=3", "train.log_every=1", "train.progress_bar=false", "train.plot=false"]
    initial = f"{root}/initial"
    train(load_recipe("apps/protein/configs/tiny.yaml", [*small, "train.seed=1", f"train.output_dir={initial}"]))
    cfg = load_recipe("apps/protein/configs/tiny_finetune.yaml",
                      [*small, f"init_from={initial}", f"train.output_dir={root}/finetune"])
    result, _ = train(cfg)
    weights = {name: load_file(str(latest_weights(run)[0])) for name, run in
               (("initial", initial), ("finetune", f"{root}/finetune"))}
    return {"losses": result.losses, "eval": result.last_eval, **weights}
