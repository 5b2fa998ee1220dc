"""Shared fixtures: real checkpoints, made once per test session (no mocks of DCP or FSDP)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/factory.py, tests/_dist.py

os.environ.setdefault("OMP_NUM_THREADS", "1")  # many small ranks on 2 cores


@pytest.fixture(scope="session", autouse=True)
def _temp_folder_left_clean(tmp_path_factory):
    """Every temporary file of the session (this process and its children: TMPDIR) goes to one
    folder, which must hold no ``pytorch-errorfile-*.pickle`` at the end.

    ``torch.multiprocessing.start_processes`` names one such file per spawned rank in the temp
    folder; a rank that raises writes its traceback there and torch never removes it. The
    launcher (``ckptool.train.launch.spawn``) and ``tests/_dist.run_dist`` remove them; this
    fails the session if anything leaves one (and keeps /tmp clean either way).
    """
    folder = tmp_path_factory.mktemp("tmp")
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
    left = sorted(p.name for p in folder.glob("pytorch-errorfile-*"))
    assert not left, f"the tests left torch error files in the temp folder: {left}"


@pytest.fixture(scope="session")
def fsdp3(tmp_path_factory) -> tuple[Path, Path]:
    """A 3-rank FSDP2 checkpoint (model + AdamW, uneven first dims) and its full reference state."""
    from factory import make_fsdp_checkpoint

    root = tmp_path_factory.mktemp("fsdp3")
    ref = root / "full.pt"
    ckpt = make_fsdp_checkpoint(root / "step_1", 3, ref=str(ref))
    return ckpt, ref


@pytest.fixture(scope="session")
def single_ckpt(tmp_path_factory) -> Path:
    """A one-rank in-process ``dcp.save`` checkpoint."""
    from factory import make_single_checkpoint

    return make_single_checkpoint(tmp_path_factory.mktemp("single") / "ckpt")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API on loopback (moto in server mode); yields the endpoint URL.

    Sets ``AWS_ENDPOINT_URL`` and dummy credentials for this process and its children, so
    ``s3://`` URLs reach it through s3fs exactly as they would reach AWS.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in
             ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def s3_bucket(s3_server, request):
    """A fresh bucket name on the loopback S3 server."""
    import uuid

    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server, skip_instance_cache=True)
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    fs.mkdir(name)
    return name


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/* from the current output")


@pytest.fixture()
def update_golden(request) -> bool:
    return bool(request.config.getoption("--update-golden"))
