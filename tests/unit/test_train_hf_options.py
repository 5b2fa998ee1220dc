"""``--hf-model`` options without a process group: the transformers extra, size flags, remote
code, the source checks and ``estimate --hf-model`` (real tiny models from ``save_pretrained``)."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.train.config import TrainConfig
from hf_models import tiny_gpt2


def test_without_transformers_train_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'ckptool\[hf\]'"):
        TrainConfig(out=str(tmp_path / "run"), hf_model="org/model")
    r = CliRunner().invoke(cli, ["train", "--out", str(tmp_path / "run"), "--hf-model", "org/model"])
    assert r.exit_code == 2 and "--hf-model needs the transformers package" in r.output
    assert "pip install 'ckptool[hf]'" in r.output
    r = CliRunner().invoke(cli, ["estimate", "--hf-model", "org/model"])
    assert r.exit_code == 2 and "pip install 'ckptool[hf]'" in r.output


def test_built_in_size_flags_are_refused_with_hf_model(tmp_path):
    with pytest.raises(ConfigError, match=r"--d-model --layers size the built-in model"):
        TrainConfig(out=str(tmp_path), hf_model="org/model", d_model=64, n_layers=2)
    # --seq-len is checked against the HF model's context at build time, not the preset's.
    assert TrainConfig(out=str(tmp_path), hf_model="org/model", seq_len=4096).seq_len == 4096


def test_remote_code_runs_only_when_trusted(tmp_path):
    from ckptool.train import hf_model

    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "ckptool-custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (folder / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'ckptool-custom'\n")
    source = hf_model.resolve(str(folder))
    assert source.weights is None and source.has_tokenizer is False
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        hf_model.load_config(source)
    assert not marker.exists()


def test_pickle_weights_are_refused_not_read(tmp_path):
    from ckptool.train import hf_model

    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    (folder / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(IncompatibleCheckpointError, match=r"pickle|\.bin"):
        hf_model.resolve(str(folder))


def test_estimate_counts_the_parameters_from_the_config_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_gpt2(tmp_path / "gpt2")
    want = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    (folder / "model.safetensors").unlink()  # no weight is read: the config is enough
    for src in (folder, folder / "config.json"):
        r = CliRunner().invoke(cli, ["estimate", "--hf-model", str(src), "--ranks", "2", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["params"] == want
    r = CliRunner().invoke(cli, ["estimate", "--hf-model", str(folder), "--params", "7B"])
    assert r.exit_code == 2 and "--hf-model takes the model from SRC" in r.output
