"""The built-in GPT: exact parameter count, stable state_dict keys, config round trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from ckptool.errors import ConfigError
from ckptool.train.model import GPT, PRESETS, ModelConfig, model_config


def _meta_model(cfg: ModelConfig) -> GPT:
    with torch.device("meta"):  # no memory: the 1b preset is counted, not allocated
        return GPT(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_is_exact_for_presets(name):
    cfg = PRESETS[name]
    assert cfg.num_params() == sum(p.numel() for p in _meta_model(cfg).parameters())


@pytest.mark.parametrize("overrides", [
    {"d_ff": 100}, {"n_layers": 1}, {"vocab": 300, "max_seq_len": 17}, {"d_model": 48, "n_heads": 3},
])
def test_num_params_is_exact_with_overrides(overrides):
    cfg = model_config("tiny", **overrides)
    assert cfg.num_params() == sum(p.numel() for p in _meta_model(cfg).parameters())


def test_preset_sizes_match_their_names():
    approx = {"125m": 125e6, "350m": 350e6, "1b": 1e9}
    for name, target in approx.items():
        assert abs(PRESETS[name].num_params() / target - 1) < 0.05, name


def test_state_dict_keys_are_simple_and_stable():
    model = GPT(ModelConfig(vocab=256, d_model=8, n_layers=1, n_heads=2, max_seq_len=4))
    assert list(model.state_dict()) == [
        "tok_emb.weight", "pos_emb.weight",
        "blocks.0.norm1.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
        "blocks.0.norm2.weight", "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight",
        "norm.weight", "head.weight",
    ]
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()  # no tying


def test_config_round_trip_and_unknown_keys():
    cfg = model_config("small", n_layers=2)
    data = cfg.to_dict()
    assert data["d_ff"] == 4 * cfg.d_model  # resolved for config.json
    assert ModelConfig.from_dict(data).num_params() == cfg.num_params()
    assert ModelConfig.from_dict(dataclasses.asdict(cfg)) == cfg
    with pytest.raises(ConfigError, match="unknown model config keys"):
        ModelConfig.from_dict({**data, "n_embd": 3})


def test_invalid_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="not divisible by --heads"):
        ModelConfig(d_model=10, n_heads=4)
    with pytest.raises(ConfigError, match="--model huge: unknown model size"):
        model_config("huge")
    with pytest.raises(ConfigError, match="at least 1"):
        model_config("tiny", n_layers=0)


def test_forward_is_causal_and_shaped():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    idx = torch.randint(0, 256, (2, 10))
    logits = model(idx)
    assert logits.shape == (2, 10, 256)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 256
    assert torch.equal(model(changed)[:, :7], logits[:, :7])
    with pytest.raises(ConfigError, match="exceeds max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("module", ["ckptool.train.sizes", "ckptool.train.config", "ckptool.cli.train"])
def test_light_modules_do_not_import_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
