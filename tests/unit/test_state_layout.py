"""Which keys are the model: real producers' checkpoints through inspect and consolidate.

Every checkpoint here is written by a real ``dcp.save`` (one process, no process group) of a
real module's state: a Hugging Face ``LlamaForCausalLM`` (whose own names start with
``model.``), the ``{"model", "optim"}`` and AppState recipes, a model with root-level
parameters and buffers, ``torch.compile``'s ``_orig_mod.`` names, and a save whose planner
records no nesting. Exports are compared name for name and ``torch.equal`` with the module's
own ``state_dict()``; HF exports load with ``from_pretrained`` with no missing or unexpected key.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed.checkpoint as dcp  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ckptool.cli import cli  # noqa: E402
from ckptool.errors import ConfigError, IncompatibleCheckpointError  # noqa: E402
from ckptool.ops.consolidate import consolidate  # noqa: E402
from ckptool.ops.inspect import inspect  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=tie)
    torch.manual_seed(1 + tie)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # untied heads must differ from the embedding
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def _adamw_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(torch.randint(0, 64, (2, 8)))
    logits = out.logits if hasattr(out, "logits") else out
    logits.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return opt


def _save(state, path: Path, **kw) -> Path:
    dcp.save(state, checkpoint_id=str(path), **kw)
    return path


def _export(ckpt: Path, out: Path, **kw) -> dict[str, torch.Tensor]:
    consolidate(ckpt, out, **kw)
    files = sorted(out.glob("*.safetensors")) if out.is_dir() else [out]
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got.update(load_file(f))
    return got


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.detach()), k


def _plain(sd) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# Hugging Face LlamaForCausalLM: its own names start with "model." and lm_head does not


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def llama(request, tmp_path_factory):
    model = _llama(request.param)
    root = tmp_path_factory.mktemp(f"llama_{'tied' if request.param else 'untied'}")
    opt = _adamw_step(model)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    ckpts = {
        "model-only": _save(model.state_dict(), root / "model_only"),
        "model+optim": _save({"model": msd, "optim": osd}, root / "model_optim"),
    }
    return model, ckpts, root


@pytest.mark.parametrize("kind", ["model-only", "model+optim"])
def test_hf_llama_export_has_the_models_own_names(llama, kind, tmp_path):
    model, ckpts, _ = llama
    got = _export(ckpts[kind], tmp_path / "out.safetensors")
    want = _plain(model.state_dict())
    # lm_head.weight is exported (it used to be dropped as "other"), model.* keeps its prefix
    assert "lm_head.weight" in got and "model.embed_tokens.weight" in got
    _assert_exact(got, want)
    s = inspect(ckpts[kind])
    assert sorted(k.fqn for k in s.groups["model"]) == sorted(
        k if kind == "model-only" else f"model.{k}" for k in want)
    assert s.names == {k.fqn: k.fqn.split(".", 1)[1] if kind != "model-only" else k.fqn
                       for k in s.groups["model"]}
    if kind == "model+optim":
        assert s.groups["optimizer"] and all(k.fqn.startswith("optim.") for k in s.groups["optimizer"])
        assert not s.groups["other"]
    else:
        assert not s.groups["optimizer"] and not s.groups["other"]


def test_hf_llama_export_loads_with_from_pretrained(llama, tmp_path):
    from transformers import LlamaForCausalLM

    model, ckpts, _ = llama
    out = tmp_path / "hf"
    _export(ckpts["model+optim"], out)
    model.config.save_pretrained(out)
    loaded, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 64, (1, 8))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_include_finds_lm_head(llama, tmp_path):
    _, ckpts, _ = llama
    got = _export(ckpts["model-only"], tmp_path / "head.safetensors", include=["lm_head*"])
    assert list(got) == ["lm_head.weight"]


# ---------------------------------------------------------------------------------------------
# The PyTorch DCP recipe: dcp.save({"app": AppState(model, optimizer)})


class _AppState:
    """The Stateful from the PyTorch DCP tutorial, as users copy it."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _toy():
    from torch import nn

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.proj = nn.Linear(6, 11)

        def forward(self, x):
            return self.proj(self.emb(x))

    torch.manual_seed(3)
    return Toy()


@pytest.fixture(scope="module")
def appstate(tmp_path_factory):
    model = _toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 11, (2, 5))).pow(2).mean().backward()
    opt.step()
    path = _save({"app": _AppState(model, opt), "epoch": 3},
                 tmp_path_factory.mktemp("appstate") / "ckpt")
    return model, path


def test_appstate_recipe_exports_only_the_model(appstate, tmp_path):
    model, path = appstate
    got = _export(path, tmp_path / "m.safetensors")
    _assert_exact(got, _plain(model.state_dict()))  # no app.model. names, no exp_avg
    s = inspect(path)
    assert {k.fqn for k in s.groups["model"]} == {f"app.model.{k}" for k in model.state_dict()}
    assert s.groups["optimizer"] and all(k.fqn.startswith("app.optim.") for k in s.groups["optimizer"])
    assert [k.fqn for k in s.groups["other"]] == ["epoch"]
    assert s.layout == "model = sub-tree 'app.model' (from planner_data)"


def test_model_key_by_hand(appstate, tmp_path):
    model, path = appstate
    got = _export(path, tmp_path / "m.safetensors", model_key="app.model")
    _assert_exact(got, _plain(model.state_dict()))
    with pytest.raises(ConfigError, match="matches no tensor.*top-level keys are app"):
        consolidate(path, tmp_path / "x.safetensors", model_key="app.nope")
    assert not (tmp_path / "x.safetensors").exists()


def test_inspect_cli_json_groups(appstate):
    _, path = appstate
    r = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {k["fqn"] for k in doc["groups"]["model"]} == {"app.model.emb.weight",
                                                        "app.model.proj.weight",
                                                        "app.model.proj.bias"}
    assert doc["names"]["app.model.proj.bias"] == "proj.bias"


# ---------------------------------------------------------------------------------------------
# Root-level parameters and buffers of a model-only save


def test_root_level_tensors_are_model_weights(tmp_path):
    from torch import nn

    class ViTish(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(0.5))
            self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
            self.register_buffer("step_count", torch.tensor(7, dtype=torch.int64))
            self.proj = nn.Linear(4, 4)

    model = ViTish()
    path = _save(model.state_dict(), tmp_path / "ckpt")
    got = _export(path, tmp_path / "out.safetensors")
    _assert_exact(got, _plain(model.state_dict()))
    assert got["step_count"].dtype == torch.int64
    assert {k.fqn for k in inspect(path).groups["model"]} == set(model.state_dict())


# ---------------------------------------------------------------------------------------------
# Wrapper segments


def test_compiled_model_names_lose_orig_mod(tmp_path):
    model = _toy()
    compiled = torch.compile(model)  # lazy: nothing is compiled, but state_dict says _orig_mod.
    sd = compiled.state_dict()
    assert all(k.startswith("_orig_mod.") for k in sd)
    path = _save({"model": sd}, tmp_path / "ckpt")
    got = _export(path, tmp_path / "out.safetensors")
    _assert_exact(got, _plain(model.state_dict()))
    kept = _export(path, tmp_path / "kept.safetensors", keep_wrappers=True)
    assert sorted(kept) == sorted(sd)


def test_names_that_collapse_are_an_error(tmp_path):
    a, b = _toy(), _toy()
    sd = {**{f"_orig_mod.{k}": v for k, v in a.state_dict().items()}, **b.state_dict()}
    path = _save(sd, tmp_path / "ckpt")
    with pytest.raises(IncompatibleCheckpointError, match="would both be exported as"):
        consolidate(path, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    got = _export(path, tmp_path / "kept.safetensors", keep_wrappers=True)
    assert sorted(got) == sorted(sd)


# ---------------------------------------------------------------------------------------------
# No planner_data: nothing is dropped, and the other reading is named


def test_without_planner_data_every_tensor_is_kept_and_the_choice_is_said(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    model = _llama(False)
    sd = _plain(model.state_dict())
    path = _save(sd, tmp_path / "ckpt", planner=DefaultSavePlanner(flatten_state_dict=False))
    from ckptool.format.metadata import read_metadata
    from ckptool.storage import Storage

    assert not read_metadata(Storage.open(path)).planner_data  # what this test is about
    r = CliRunner().invoke(cli, ["consolidate", str(path), str(tmp_path / "o.safetensors")])
    assert r.exit_code == 0, r.output
    assert "note:" in r.output and "--model-key model" in r.output
    _assert_exact(load_file(tmp_path / "o.safetensors"), sd)
    # the other reading, chosen by hand
    got = _export(path, tmp_path / "stripped.safetensors", model_key="model")
    assert "embed_tokens.weight" in got and "lm_head.weight" not in got


# ---------------------------------------------------------------------------------------------
# Checkpointer.load never loads part of a checkpoint silently


@pytest.mark.parametrize("layers, shape, match", [
    (2, 8, "the checkpoint has 4 tensors this model lacks"),   # fewer layers: DCP loads a part
    (6, 8, "this model has 4 tensors the checkpoint lacks"),
    (4, 6, r"0.bias is \[8\] in the checkpoint, \[6\] in this model \(and 7 more\)"),
])
def test_checkpointer_load_refuses_a_model_that_does_not_match(tmp_path, layers, shape, match):
    from ckptool.checkpoint import Checkpointer

    def net(n, d):
        return torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(n)])

    saved = net(4, 8)
    ck = Checkpointer(tmp_path / "run")
    ck.save(1, saved, torch.optim.AdamW(saved.parameters()))
    other = net(layers, shape)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(IncompatibleCheckpointError, match=match):
        ck.load(tmp_path / "run" / "step_1", other, torch.optim.AdamW(other.parameters()))
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched
    same = net(4, 8)
    assert ck.load(tmp_path / "run" / "step_1", same, torch.optim.AdamW(same.parameters())) == 1
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(),
                                                 saved.state_dict().values()))


def test_load_pretrained_refuses_a_larger_checkpoint(tmp_path):
    from ckptool.checkpoint import Checkpointer

    def net(n):
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])

    saved = net(4)
    ck = Checkpointer(tmp_path / "run")
    ck.save(1, saved, torch.optim.AdamW(saved.parameters()))
    with pytest.raises(IncompatibleCheckpointError, match="4 tensors this model lacks"):
        ck.load_pretrained(net(2), tmp_path / "run" / "step_1")
    same = net(4)
    ck.load_pretrained(same, tmp_path / "run" / "step_1")
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(),
                                                 saved.state_dict().values()))
