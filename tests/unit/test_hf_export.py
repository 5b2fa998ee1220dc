"""Exports that load with ``from_pretrained`` as they are: config, tokenizer, tied embeddings.

Real ``transformers`` models and tokenizers, real ``save_pretrained``, ``dcp.save`` and
``ckptool import``; no file is hand-written except a config edited to lie about tying.
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
from ckptool.errors import IncompatibleCheckpointError  # noqa: E402
from ckptool.ops.consolidate import consolidate  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=tie)
    torch.manual_seed(7 + tie)
    return LlamaForCausalLM(cfg)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(63)} | {"<unk>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_model(request, tmp_path_factory):
    """A pretrained-style folder (weights, config, generation config, tokenizer) and its
    model-only DCP save."""
    model = _llama(request.param)
    root = tmp_path_factory.mktemp("hf_export")
    model.save_pretrained(root / "pretrained")
    _tokenizer().save_pretrained(root / "pretrained")
    dcp.save(model.state_dict(), checkpoint_id=str(root / "dcp"))
    return model, root


def _assert_loads_as_is(out: Path, model) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tied = model.config.tie_word_embeddings
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("w3 w5")["input_ids"] == [3, 5]


def test_hf_assets_make_the_export_load_as_is(hf_model, tmp_path):
    model, root = hf_model
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["consolidate", str(root / "dcp"), str(out),
                                 "--hf-assets", str(root / "pretrained")])
    assert r.exit_code == 0, r.output
    written = load_file(out / "model.safetensors")
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in written) == (not tied)  # written once when tied
    assert ("tied to model.embed_tokens.weight" in r.output) == tied
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    _assert_loads_as_is(out, model)


def test_import_then_consolidate_needs_no_manual_step(hf_model, tmp_path):
    """import records config and tokenizer in the checkpoint; consolidate writes them back."""
    model, root = hf_model
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    r = CliRunner().invoke(cli, ["import", str(root / "pretrained"), str(ckpt), "--ranks", "2",
                                 "--dtype", "keep"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["consolidate", str(ckpt), str(out)])
    assert r.exit_code == 0, r.output
    _assert_loads_as_is(out, model)


def test_config_that_lies_about_tying_is_refused(hf_model, tmp_path):
    model, root = hf_model
    if model.config.tie_word_embeddings:
        pytest.skip("the untied model's head differs from its embedding")
    liar = tmp_path / "liar"
    liar.mkdir()
    cfg = json.loads((root / "pretrained" / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (liar / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(IncompatibleCheckpointError, match="would load a wrong head"):
        consolidate(root / "dcp", tmp_path / "out", hf_assets=liar)
    assert not (tmp_path / "out").exists()


def test_single_file_output_says_where_the_assets_go(hf_model, tmp_path):
    _, root = hf_model
    r = CliRunner().invoke(cli, ["import", str(root / "pretrained"), str(tmp_path / "ckpt"),
                                 "--ranks", "1"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["consolidate", str(tmp_path / "ckpt"),
                                 str(tmp_path / "m.safetensors")])
    assert r.exit_code == 0, r.output
    assert "give a folder OUTPUT" in r.output


# ---------------------------------------------------------------------------------------------
# upload: every file of the export, config.json from what the checkpoint knows, an HF card


def _card_meta(text: str) -> dict:
    import yaml

    return yaml.safe_load(text.split("---")[1])


def test_upload_of_an_imported_checkpoint_sends_config_and_tokenizer(hf_model, tmp_path):
    from ckptool.ops.upload import upload

    model, root = hf_model
    ckpt = tmp_path / "ckpt"
    assert CliRunner().invoke(cli, ["import", str(root / "pretrained"), str(ckpt),
                                    "--ranks", "2"]).exit_code == 0
    r = upload(ckpt, "alice/llama-ft", dry_run=True)
    sent = {f.path_in_repo for f in r.files}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md", "model.safetensors"} <= sent


def test_checkpointer_given_an_hf_config_uploads_a_loadable_repo(tmp_path, monkeypatch):
    """A Checkpointer given a transformers config used to make upload fail ('unknown model
    config keys'); now config.json is the model's and the card says transformers."""
    import ckptool.ops.upload as up
    from ckptool.checkpoint import Checkpointer

    model = _llama(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(tmp_path / "run", hf_config=model.config,
                      config={"model_config": model.config.to_dict()})
    ck.save(1, model, opt)
    ck.close()
    staged = {}
    real_card = up._write_card

    def keep(stage, *a, **kw):  # observe (not replace) the staging step: read its files
        real_card(stage, *a, **kw)
        staged.update({p.name: p.read_bytes() for p in stage.iterdir()})

    monkeypatch.setattr(up, "_write_card", keep)
    r = up.upload(tmp_path / "run", "alice/llama-ft", dry_run=True)
    assert "config.json" in {f.path_in_repo for f in r.files}
    assert json.loads(staged["config.json"])["model_type"] == "llama"
    meta = _card_meta(staged["README.md"].decode())
    assert meta["library_name"] == "transformers" and "llama" in meta["tags"]
    assert "AutoModelForCausalLM.from_pretrained" in staged["README.md"].decode()
    out = tmp_path / "export"
    out.mkdir()
    for name, data in staged.items():
        (out / name).write_bytes(data)
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_hf_assets_from_a_hub_repo_fetches_assets_only(hf_model, tmp_path):
    """--hf-assets org/name through the real huggingface_hub client (local Hub server): only
    config, generation config and tokenizer files are downloaded, never the weights."""
    import os
    import subprocess
    import sys

    from hub_server import HubServer

    model, root = hf_model
    files = {p.name: p.read_bytes() for p in (root / "pretrained").iterdir()}
    with HubServer() as hub:
        hub.put_files("org/base", files)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf"),
                   HF_HUB_DISABLE_TELEMETRY="1")
        out = tmp_path / "out"
        proc = subprocess.run([sys.executable, "-m", "ckptool", "consolidate", str(root / "dcp"),
                               str(out), "--hf-assets", "org/base@main"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        fetched = {p.rsplit("/", 1)[-1] for _, p in hub.requests if "/resolve/" in p}
    assert "model.safetensors" not in fetched and "config.json" in fetched
    assert "tokenizer.json" in fetched
    _assert_loads_as_is(out, model)


def test_hf_assets_link_out_of_the_folder_is_refused(hf_model, tmp_path):
    """An asset that links elsewhere (say, to a secret) is never copied into an export."""
    from ckptool.errors import ConfigError

    _, root = hf_model
    folder = tmp_path / "assets"
    folder.mkdir()
    (folder / "config.json").write_bytes((root / "pretrained" / "config.json").read_bytes())
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (folder / "tokenizer.json").symlink_to(secret)
    with pytest.raises(ConfigError, match="tokenizer.json is a link leading out of the folder"):
        consolidate(root / "dcp", tmp_path / "out", hf_assets=folder)
    assert not (tmp_path / "out").exists()
