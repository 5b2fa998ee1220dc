"""``ckptool.upload`` in-process: the checks made before sending, options, staging clean-up,
config.json and the mapping of Hub errors. Dry runs only, so nothing needs a network, except the
error-mapping test, which talks to the local fake Hub."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from ckptool import upload
from ckptool.errors import CkptError, ConfigError, CorruptCheckpointError
from hub_server import HubServer


def _save(path: Path, tensors: dict, metadata: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    return path


def _shards(folder: Path) -> Path:
    folder.mkdir()
    _save(folder / "model-00001-of-00002.safetensors", {"a": np.zeros((2, 3), np.float32)})
    _save(folder / "model-00002-of-00002.safetensors", {"b": np.ones(5, np.int64)})
    index = {"metadata": {"total_size": 24 + 40}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _edit_index(folder: Path, change) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


@pytest.fixture(autouse=True)
def own_tmp(tmp_path, monkeypatch) -> Path:
    """Temporary folders go to tmp_path/tmp, so tests can see that they are removed."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    yield tmp_path / "tmp"
    assert not list((tmp_path / "tmp").iterdir()), "staging folder left behind"


def test_dry_run_of_shards(tmp_path):
    r = upload(_shards(tmp_path / "s"), "alice/x", dry_run=True)
    assert (r.kind, r.tensors, r.dtype, r.dry_run, r.commit_url) == \
        ("shards", 2, "float32, int64", True, None)
    assert [f.path_in_repo for f in r.files] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "README.md"]


def test_truncated_file_is_refused(tmp_path):
    path = _save(tmp_path / "m.safetensors", {"w": np.zeros((4, 4), np.float32)})
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CorruptCheckpointError, match=r"m.safetensors: not a valid safetensors "
                                                     r"file: tensor 'w' ends at data byte 64, past "
                                                     r"the end of the file.*nothing was sent"):
        upload(path, "alice/x", dry_run=True)


def test_garbage_and_inconsistent_headers_are_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 7) + b"notjson")
    with pytest.raises(CorruptCheckpointError, match="not a valid safetensors file"):
        upload(path, "alice/x", dry_run=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(12))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' spans 12 bytes but shape "
                                                     r"\[2, 2\] of float32 needs 16"):
        upload(path, "alice/x", dry_run=True)


@pytest.mark.parametrize("change, message", [
    (lambda ix: ix["metadata"].update(total_size=63), "metadata.total_size is 63 but the shards "
                                                      "hold 64 bytes"),
    (lambda ix: ix["weight_map"].update(c="model-00003-of-00003.safetensors"),
     "names model-00003-of-00003.safetensors, which does not exist"),
    (lambda ix: ix["weight_map"].update(c="model-00001-of-00002.safetensors"),
     "puts c in model-00001-of-00002.safetensors, which does not hold it"),
    (lambda ix: ix["weight_map"].pop("b"), "total_size is 64 but the shards hold 24 bytes"),
    (lambda ix: ix["weight_map"].update(a="../elsewhere.safetensors"), "not a safetensors index"),
])
def test_inconsistent_index_is_refused(tmp_path, change, message):
    folder = _shards(tmp_path / "s")
    _edit_index(folder, change)
    with pytest.raises(CorruptCheckpointError, match=message):
        upload(folder, "alice/x", dry_run=True)


def test_tensor_missing_from_index_is_refused(tmp_path):
    folder = _shards(tmp_path / "s")
    _save(folder / "model-00001-of-00002.safetensors", {"a": np.zeros((2, 3), np.float32),
                                                        "extra": np.zeros(1, np.float32)})
    _edit_index(folder, lambda ix: ix["metadata"].update(total_size=68))
    with pytest.raises(CorruptCheckpointError, match="model-00001-of-00002.safetensors holds "
                                                     "extra, which its weight_map does not list"):
        upload(folder, "alice/x", dry_run=True)


@pytest.mark.parametrize("kwargs, message", [
    ({"repo_id": "not a repo"}, "is not a valid repo id"),
    ({"dtype": "bfloat16"}, "--dtype, --max-shard-size, --model-key and --keep-wrappers apply to DCP checkpoints"),
    ({"create_pr": True, "revision": "dev"}, "--create-pr opens a pull request against main"),
    ({"path_in_repo": "a/../b"}, "must be a plain relative folder"),
])
def test_bad_options(tmp_path, kwargs, message):
    path = _save(tmp_path / "m.safetensors", {"w": np.zeros(3, np.float32)})
    kwargs = {"repo_id": "alice/x", **kwargs}
    with pytest.raises(ConfigError, match=message):
        upload(path, kwargs.pop("repo_id"), dry_run=True, **kwargs)
    (tmp_path / "m.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="is not a .safetensors file"):
        upload(tmp_path / "m.bin", "alice/x", dry_run=True)


def test_dcp_dry_run_reports_progress_and_cleans_up(single_ckpt):
    seen = []
    r = upload(single_ckpt, "alice/x", dry_run=True, progress=lambda d, t: seen.append((d, t)))
    assert r.kind == "dcp" and r.tensors == 3 and seen and seen[-1][0] == seen[-1][1]
    assert (r.step, r.world_size, r.loss) == (None, 1, None)  # no manifest: header provenance
    assert [f.path_in_repo for f in r.files] == ["model.safetensors", "README.md"]  # no manifest


def test_failed_export_removes_the_staging_folder(single_ckpt, tmp_path):
    broken = tmp_path / "step_3"
    shutil.copytree(single_ckpt, broken)
    for f in broken.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(CkptError):
        upload(broken, "alice/x", dry_run=True)


def test_model_config_json_round_trip():
    from ckptool.ops.model_card import model_config_json
    from ckptool.train.sizes import PRESETS, ModelConfig

    obj = json.loads(model_config_json(PRESETS["tiny"].to_dict()))
    assert obj.pop("model_type") == "ckptool-gpt"
    assert ModelConfig.from_dict(obj).to_dict() == PRESETS["tiny"].to_dict()
    with pytest.raises(ConfigError, match="unknown model config keys"):
        model_config_json({**PRESETS["tiny"].to_dict(), "n_experts": 8})


def test_hub_errors_are_mapped_through_wrapping():
    from huggingface_hub.utils import get_session, hf_raise_for_status

    from ckptool.ops.upload import _hub_error

    with HubServer() as hub:
        url = hub.url
        response = get_session().get(f"{url}/api/models/alice/none")
    with pytest.raises(Exception) as info:
        try:
            hf_raise_for_status(response)
        except Exception as e:  # the LFS path wraps errors like this
            raise RuntimeError("Error while uploading 'x' to the Hub.") from e
    err = _hub_error(info.value, "uploading to alice/none", url, "alice/none")
    assert str(err) == (f"alice/none not found at the Hub at {url} (404) while uploading to "
                        "alice/none: Repository not found. Check REPO_ID (namespace/name) and "
                        "that the token can see it")
    assert _hub_error(ValueError("unrelated"), "x", url, None) is None
