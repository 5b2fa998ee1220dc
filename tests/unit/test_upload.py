"""``ckptool upload`` end to end: the real huggingface_hub client against a local fake Hub.

Each test starts ``tests/hub_server.py`` on 127.0.0.1 and runs the CLI in a subprocess with
``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET=1`` (the git-lfs path, which a local server can serve),
``HF_HOME`` and ``TMPDIR`` pointing into ``tmp_path``, so huggingface_hub's import-time
constants are right and nothing reaches the real Hub. Every run asserts that the token appears
nowhere in stdout or stderr and that the temporary export folder is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from hub_server import HubServer

TOKEN = "hf_test_token_0123456789"
NOT_LOGGED_IN = "error: Not logged in. Run 'hf auth login' or pass --token / set HF_TOKEN\n"


@pytest.fixture
def hub():
    with HubServer(tokens={TOKEN: "alice"}, max_seconds=120) as server:
        yield server
    assert not server.unknown, f"client called endpoints the test server lacks: {server.unknown}"


def run_upload(endpoint: str, tmp: Path, *args: str, token: str | None = TOKEN,
               secret: str = TOKEN) -> subprocess.CompletedProcess:
    """Run ``ckptool upload ARGS`` in a subprocess against ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp / "hf_home"),
               HF_HUB_DISABLE_TELEMETRY="1", TMPDIR=str(tmp / "tmpdir"))
    if token is not None:
        env["HF_TOKEN"] = token
    (tmp / "tmpdir").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "ckptool", "upload", *args], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=90)
    assert secret not in proc.stdout + proc.stderr, "the token was printed"
    assert not list((tmp / "tmpdir").iterdir()), "the temporary folder was left behind"
    return proc


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def card_meta(readme: bytes) -> dict:
    text = readme.decode()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture
def weights_file(tmp_path) -> Path:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.safetensors"
    save_file({"emb.weight": rng.standard_normal((8, 4)).astype(np.float32),
               "norm.weight": rng.standard_normal(4).astype(np.float16),
               "pos": np.arange(8, dtype=np.int64)}, str(path), metadata={"source_step": "40"})
    return path


def make_shards(folder: Path, n: int = 3) -> Path:
    """``n`` HF-style shards of different content plus their index."""
    from safetensors.numpy import save_file

    folder.mkdir()
    weight_map, total = {}, 0
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        arr = np.full((16, 8), i + 1, dtype=np.float32)
        save_file({f"blocks.{i}.w": arr}, str(folder / name))
        weight_map[f"blocks.{i}.w"], total = name, total + arr.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def run_dir(single_ckpt, tmp_path_factory) -> Path:
    """A run folder whose ``step_3`` is a real DCP checkpoint with a ckptool manifest."""
    from ckptool.format.manifest import build_manifest, write_manifest
    from ckptool.storage import Storage
    from ckptool.train.sizes import ModelConfig

    run = tmp_path_factory.mktemp("upload_run")
    shutil.copytree(single_ckpt, run / "step_3")
    storage = Storage.open(run / "step_3")
    config = {"model": "tiny", "steps": 3, "lr": 0.003, "out": "/home/alice/private/runs",
              "model_config": ModelConfig(d_model=32, n_layers=2, n_heads=2).to_dict(),
              "precision": "fp32"}
    write_manifest(storage, build_manifest(storage, step=3, world_size=2, loss=2.5, config=config))
    return run


def test_upload_safetensors_file(hub, tmp_path, weights_file):
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/tiny")
    assert proc.returncode == 0, proc.stderr
    commit = hub.repos["alice/tiny"].commits[-1]
    assert proc.stdout.startswith("uploaded 2 files")
    assert proc.stdout.strip().endswith(f"{hub.url}/alice/tiny/commit/{commit['oid']}")
    files = hub.files("alice/tiny")
    assert set(files) == {"model.safetensors", "README.md"}
    assert files["model.safetensors"] == weights_file.read_bytes()
    meta = card_meta(files["README.md"])
    assert meta["library_name"] == "ckptool" and "ckptool" in meta["tags"]
    assert "| step | 40 |" in files["README.md"].decode()
    assert commit["summary"] == "Upload tiny.safetensors (step 40) with ckptool " + \
        __import__("ckptool").__version__
    assert hub.puts == [(sha256(weights_file), "ok")]


def test_upload_dcp_checkpoint_of_builtin_model(hub, tmp_path, run_dir):
    from ckptool.ops.consolidate import consolidate
    from ckptool.train.sizes import ModelConfig

    proc = run_upload(hub.url, tmp_path, str(run_dir), "alice/tiny-gpt", "--max-shard-size",
                      "64B", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["kind"], result["step"], result["world_size"], result["loss"]) == \
        ("dcp", 3, 2, 2.5)
    assert result["user"] == "alice" and result["commit_url"].startswith(hub.url)
    ref = consolidate(run_dir / "step_3", tmp_path / "ref", max_shard_size=64)
    files = hub.files("alice/tiny-gpt")
    assert set(files) == {Path(f).name for f in ref.files} | {"README.md", "config.json"}
    assert "model.safetensors.index.json" in files and len(ref.files) >= 3
    for f in ref.files:
        assert files[Path(f).name] == Path(f).read_bytes()
    want = {"model_type": "ckptool-gpt", **ModelConfig(d_model=32, n_layers=2, n_heads=2).to_dict()}
    assert json.loads(files["config.json"]) == want
    card = files["README.md"].decode()
    assert "ckptool-gpt" in card_meta(files["README.md"])["tags"]
    for row in ("| step | 3 |", "| loss | 2.5000 |", "| world size (ranks) | 2 |", "lr: 0.003",
                "model.safetensors.index.json", "GPT(ModelConfig.from_dict(config))"):
        assert row in card
    assert "/home/alice" not in card
    assert [r["path_in_repo"] for r in result["files"]][-3:] == \
        ["model.safetensors.index.json", "README.md", "config.json"]
    # The export is deterministic, so a re-run (e.g. after an interruption) sends nothing again.
    puts, commits = len(hub.puts), len(hub.repos["alice/tiny-gpt"].commits)
    proc = run_upload(hub.url, tmp_path, str(run_dir), "alice/tiny-gpt", "--max-shard-size", "64B")
    assert proc.returncode == 0, proc.stderr
    assert (len(hub.puts), len(hub.repos["alice/tiny-gpt"].commits)) == (puts, commits)


def test_shards_to_branch_and_subfolder(hub, tmp_path):
    shards = make_shards(tmp_path / "export")
    proc = run_upload(hub.url, tmp_path, str(shards), "alice/m", "--revision", "dev",
                      "--path-in-repo", "/exports/v1/", "--commit-message", "first export")
    assert proc.returncode == 0, proc.stderr
    files = hub.files("alice/m", "dev")
    local = {p.name: p.read_bytes() for p in shards.iterdir()}
    assert {k: v for k, v in files.items() if k != "exports/v1/README.md"} == \
        {f"exports/v1/{k}": v for k, v in local.items()}
    assert 'f"{folder}/exports/v1/model.safetensors.index.json"' in \
        files["exports/v1/README.md"].decode()
    assert hub.files("alice/m", "main") == {}
    assert hub.repos["alice/m"].commits[-1]["summary"] == "first export"


def test_create_pr(hub, tmp_path, weights_file):
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/tiny", "--create-pr", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pr_url"] == f"{hub.url}/alice/tiny/discussions/1"
    assert set(hub.files("alice/tiny", "refs/pr/1")) == {"model.safetensors", "README.md"}
    assert hub.files("alice/tiny", "main") == {}


def test_dry_run_sends_nothing_and_needs_no_token(hub, tmp_path, weights_file, run_dir):
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/tiny", "--dry-run", token=None)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("dry run: would upload 2 files") and out[0].endswith("nothing sent")
    assert out[1].split() == ["model.safetensors", str(weights_file.stat().st_size), "B"]
    assert out[2].split()[0] == "README.md"
    proc = run_upload(hub.url, tmp_path, str(run_dir / "step_3"), "alice/tiny", "--dry-run",
                      "--json", "--dtype", "bfloat16", token=None)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["dry_run"] and result["commit_url"] is None and result["dtype"] == "bfloat16"
    assert [f["path_in_repo"] for f in result["files"]] == \
        ["model.safetensors", "README.md", "config.json"]
    assert hub.requests == []


def test_not_logged_in(hub, tmp_path, weights_file):
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/tiny", token=None)
    assert (proc.returncode, proc.stderr) == (1, NOT_LOGGED_IN)
    assert hub.requests == []


def test_token_option_and_rejected_token(hub, tmp_path, weights_file):
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/tiny", "--token", TOKEN,
                      token=None)
    assert proc.returncode == 0, proc.stderr
    wrong = "hf_wrong_token_9876543210"
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/other", "--token", wrong,
                      secret=wrong)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: the Hub at {hub.url} did not accept the token (401) "
                                  "while checking the token. Run 'hf auth login' again")
    assert proc.stderr.count("\n") == 1 and "alice/other" not in hub.repos


def test_no_permission_on_create(hub, tmp_path, weights_file):
    proc = run_upload(hub.url, tmp_path, str(weights_file), "bob/model")
    assert proc.returncode == 1
    assert last_line(proc.stderr).startswith(
        f"error: the Hub at {hub.url} refused access to bob/model (403) while creating "
        "bob/model: You don't have the rights")
    assert "Traceback" not in proc.stderr
    assert hub.puts == [] and not hub.repos


def test_connection_refused(tmp_path, weights_file):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    proc = run_upload(endpoint, tmp_path, str(weights_file), "alice/tiny")
    assert proc.returncode == 1
    line = last_line(proc.stderr)
    assert line.startswith(f"error: cannot reach the Hub at {endpoint} while checking the token")
    assert line.endswith("Re-run the same command to resume: files the Hub already has are not "
                         "sent again")


def test_server_error_then_rerun_resumes(hub, tmp_path):
    shards = make_shards(tmp_path / "export")
    oids = [sha256(p) for p in sorted(shards.glob("*.safetensors"))]
    hub.fail_put[oids[1]] = ["500", None]  # every try of shard 2 fails (client retries 5 times)
    proc = run_upload(hub.url, tmp_path, str(shards), "alice/m")
    assert proc.returncode == 1
    assert last_line(proc.stderr).startswith(f"error: the Hub at {hub.url} answered 500 while "
                                             "uploading to alice/m")
    assert "Re-run the same command to resume" in last_line(proc.stderr)
    assert hub.repos["alice/m"].commits == []
    assert set(hub.lfs) == {oids[0], oids[2]}

    hub.fail_put.clear()
    proc = run_upload(hub.url, tmp_path, str(shards), "alice/m")
    assert proc.returncode == 0, proc.stderr
    assert [hub.put_count(o, "ok") for o in oids] == [1, 1, 1]  # nothing sent twice
    assert hub.put_count(oids[1], "500") == 6
    files = hub.files("alice/m")
    for p in shards.iterdir():
        assert files[p.name] == p.read_bytes()


def test_dropped_connection_is_retried(hub, tmp_path, weights_file):
    hub.fail_put[sha256(weights_file)] = ["drop", 1]
    proc = run_upload(hub.url, tmp_path, str(weights_file), "alice/tiny")
    assert proc.returncode == 0, proc.stderr
    assert [out for _, out in hub.puts] == ["drop", "ok"]
    assert hub.files("alice/tiny")["model.safetensors"] == weights_file.read_bytes()


def test_help_imports_neither_hub_nor_torch():
    code = ("import sys; from click.testing import CliRunner; from ckptool.cli import cli; "
            "r = CliRunner().invoke(cli, ['upload', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'huggingface_hub' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
