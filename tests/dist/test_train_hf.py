"""``ckptool train --hf-model``: a real tiny ``LlamaForCausalLM`` (untied, own tokenizer) and
``GPT2LMHeadModel`` (tied, no tokenizer), saved with ``save_pretrained``, fine-tuned with FSDP2
on 2 gloo ranks: logits before any step equal ``from_pretrained``'s, loss falls, resume is
bitwise at 2 ranks and within 1e-3 at 1 rank, and ``consolidate`` gives a folder that
``from_pretrained`` loads with the trained weights exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from _dist import load_tensors, run_dist
from hf_models import tiny_gpt2, tiny_llama
from ckptool.ops.consolidate import consolidate
from ckptool.train.config import TrainConfig
from ckptool.train.launch import launch

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {"llama": str(tiny_llama(root / "llama")), "gpt2": str(tiny_gpt2(root / "gpt2"))}


def _cfg(out: Path, src: str, **kw) -> TrainConfig:
    base = {"out": str(out), "nproc": 2, "hf_model": src, "steps": 20, "save_every": 10, "keep": 0,
            "log_every": 10, "lr_decay_steps": 20, "batch_size": 8, "seq_len": 32}
    return TrainConfig(**{**base, **kw})


def _logits_worker(rank: int, world_size: int, folders: list[str]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from ckptool.train import hf_model, parallel

    out = []
    for folder in folders:
        cfg = TrainConfig(out="unused", hf_model=folder, seq_len=16)
        source = hf_model.resolve(folder)
        config = hf_model.load_config(source)
        mesh = parallel.build_mesh("full", world_size, "cpu")
        model = hf_model.build(config, cfg, mesh, torch.device("cpu"), "fp32")
        read = hf_model.load_weights(model, source.weights, tied_head=hf_model.tied_head(config, model))
        ref = AutoModelForCausalLM.from_pretrained(folder)
        x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
        model.eval()  # GPT-2 has dropout; from_pretrained returns an eval-mode model
        with torch.no_grad():
            got, want = model(x), ref(x).logits
        out.append({
            "equal": torch.equal(got, want),
            "tied": model.lm_head.weight is model.get_input_embeddings().weight,
            "read": read, "full": sum(p.numel() * 4 for p in ref.parameters()),
            "buffers": all(torch.equal(b, dict(ref.named_buffers())[n]) for n, b in model.named_buffers()),
            "names": sorted(hf_model.model_names(model)) == sorted(ref.state_dict()) or
                     sorted(hf_model.model_names(model)) == sorted(k for k in ref.state_dict() if k != "lm_head.weight"),
        })
    # A config.json alone: the model's own init on each shard, shards different (not copies).
    source = hf_model.resolve(os.path.join(folders[1], "config.json"))
    assert source.weights is None
    model = hf_model.build(hf_model.load_config(source), cfg, mesh, torch.device("cpu"), "fp32")
    hf_model.random_init(model, seed=0)
    out.append({"wte": model.transformer.wte.weight.to_local().detach().clone()})
    return out


def test_sharded_logits_equal_from_pretrained_each_rank_reading_its_rows(models):
    results = run_dist(_logits_worker, 2, [models["llama"], models["gpt2"]])
    wte = [rank[2]["wte"] for rank in results]
    assert wte[0].shape == wte[1].shape and not torch.equal(wte[0], wte[1])
    assert 0.015 < float(torch.cat(wte).std()) < 0.025  # GPT-2's N(0, 0.02)
    for rank in results:
        llama, gpt2, _ = rank
        assert llama["equal"] and gpt2["equal"]
        assert llama["buffers"] and llama["names"] and gpt2["names"]  # rotary inv_freq recomputed
        assert not llama["tied"] and gpt2["tied"]
        # Each rank reads about half of the bytes, never the whole model.
        for r in rank[:2]:
            assert r["read"] < 0.6 * r["full"]


def test_llama_train_resume_at_2_and_1_ranks_then_consolidate_loads(models, tmp_path):
    a = launch(_cfg(tmp_path / "a", models["llama"]))
    assert a.checkpoints == ["step_10", "step_20"] and len(a.losses) == 20
    assert sum(a.losses[-5:]) / 5 < a.losses[0] - 0.3
    assert a.model_params == 39072

    # Resume from step 10 on 2 ranks: bitwise; on 1 rank: the same within 1e-3.
    b = launch(_cfg(tmp_path / "b", models["llama"], resume_from=str(tmp_path / "a/step_10")))
    assert b.start_step == 10 and b.losses == a.losses[10:]
    c = launch(_cfg(tmp_path / "c", models["llama"], nproc=1, resume_from=str(tmp_path / "a/step_10")))
    assert c.losses == pytest.approx(a.losses[10:], abs=1e-3)

    # consolidate: a folder from_pretrained loads as it is, with the trained weights exactly.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step = tmp_path / "a/step_20"
    assert sorted(os.listdir(step / "hf_assets")) == ["config.json", "generation_config.json",
                                                       "tokenizer.json", "tokenizer_config.json"]
    consolidate(str(step), str(tmp_path / "export"))
    trained = {k[len("model."):]: v for k, v in load_tensors(step).items() if k.startswith("model.")}
    assert "model.layers.0.self_attn.q_proj.weight" in trained  # the model's own names
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    sd = loaded.state_dict()
    assert sorted(sd) == sorted(trained)
    assert all(torch.equal(sd[k], trained[k]) for k in sd)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "export")) == 300


def test_gpt2_tied_with_activation_checkpointing_and_bf16(models, tmp_path):
    r = launch(_cfg(tmp_path / "g", models["gpt2"], steps=6, save_every=6, lr_decay_steps=6,
                    activation_checkpointing="every", mixed_precision="bf16"))
    assert r.precision == "bf16" and len(r.losses) == 6 and r.losses[-1] < r.losses[0]
    step = tmp_path / "g/step_6"
    manifest = json.loads((step / "ckptool.json").read_text())
    assert manifest["config"]["hf_config"]["model_type"] == "gpt2"
    assert "tokenizer.json" not in manifest["config"]["hf_assets"]  # none in the source
    trained = {k[len("model."):]: v for k, v in load_tensors(step).items() if k.startswith("model.")}
    assert not any("_checkpoint_wrapped_module" in k for k in trained)
    from transformers import AutoModelForCausalLM

    consolidate(str(step), str(tmp_path / "export"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    sd = loaded.state_dict()
    assert all(torch.equal(sd[k], trained[k]) for k in trained)
