"""``ckptool import`` on real ``save_pretrained`` folders of a tiny ``LlamaForCausalLM``.

Every output is read back with torch's own ``dcp.load`` and compared with ``torch.equal`` to
the weights safetensors holds (after the fp32 cast). Hostile inputs are refused with one line
and nothing written. The Hub is the local ``tests/hub_server.py`` driven by the real
``huggingface_hub`` client in a subprocess. Loading into FSDP2 models on 2 and 3 gloo ranks is
in ``tests/dist/test_import_dist.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import load_tensors
from ckptool.cli import main
from ckptool.format import manifest as mf
from ckptool.format.metadata import read_metadata
from ckptool.ops.import_hf import import_hf
from ckptool.ops.validate import validate
from ckptool.storage import Storage


def tiny_config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=67, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       tie_word_embeddings=tie)


def save_llama(path: Path, *, tie: bool, dtype: str, sharded: bool, seed: int = 0) -> Path:
    """A tiny Llama saved with ``save_pretrained`` (sharded: several files and an index)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tie)).to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size="12KB" if sharded else "5GB")
    return path


def hf_weights(path: Path) -> dict:
    """name -> tensor of every safetensors file in an HF folder (safetensors' own reader)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple, Path]:
    root = tmp_path_factory.mktemp("hf")
    variants = [(True, "bfloat16", True), (False, "float32", False), (True, "float32", False),
                (False, "bfloat16", True)]
    return {v: save_llama(root / "-".join(map(str, v)), tie=v[0], dtype=v[1], sharded=v[2])
            for v in variants}


def _model_keys(tie: bool) -> list[str]:
    from transformers import LlamaForCausalLM

    return sorted(LlamaForCausalLM(tiny_config(tie)).state_dict())


@pytest.mark.parametrize("variant", [(True, "bfloat16", True), (False, "float32", False),
                                     (True, "float32", False), (False, "bfloat16", True)],
                         ids=lambda v: f"tie={v[0]}-{v[1]}-{'sharded' if v[2] else 'single'}")
def test_import_matches_hf_weights_and_fsdp_layout(models, variant, tmp_path):
    import torch

    src = models[variant]
    tie, _, sharded = variant
    assert (src / "model.safetensors.index.json").exists() == sharded
    assert ("lm_head.weight" in hf_weights(src)) == (not tie)  # save_pretrained drops the tie
    r = import_hf(src, tmp_path / "ck", world_size=2)
    assert r.verified and r.world_size == 2 and r.tied == (["model.lm_head.weight"] if tie else [])
    got = load_tensors(tmp_path / "ck")
    assert sorted(got) == [f"model.{k}" for k in _model_keys(tie)]  # what state_dict() lists
    ref = hf_weights(src)
    if tie:
        ref["lm_head.weight"] = ref["model.embed_tokens.weight"]
    for name, t in ref.items():
        assert got[f"model.{name}"].dtype == torch.float32
        assert torch.equal(got[f"model.{name}"], t.float()), name
    meta = read_metadata(Storage.open(tmp_path / "ck"))
    for fqn, t in meta.tensors.items():  # rank r's file holds torch.chunk(dim 0) piece r
        pieces = torch.chunk(torch.empty(t.shape), 2)
        assert [(c.storage.relative_path, c.offsets[0], c.sizes) for c in t.chunks] == [
            (f"__{r}_0.distcp", r * pieces[0].shape[0], tuple(p.shape))
            for r, p in enumerate(pieces)]
        assert meta.planner_data[fqn] == ("model", fqn[len("model."):])
    report = validate(tmp_path / "ck", deep=True)
    assert report.ok, report.errors


def test_manifest_records_config_and_assets(models, tmp_path):
    src = models[(True, "bfloat16", True)]
    r = import_hf(src, tmp_path / "ck", world_size=3)
    man = mf.read_manifest(Storage.open(tmp_path / "ck"))
    assert man.world_size == 3 and man.source["operation"] == "import"
    assert man.config["hf_config"] == json.loads((src / "config.json").read_text())
    assert man.config["hf_assets"] == {"config.json": "hf_assets/config.json",
                                       "generation_config.json": "hf_assets/generation_config.json"}
    for name, rel in man.config["hf_assets"].items():
        assert (tmp_path / "ck" / rel).read_bytes() == (src / name).read_bytes()
        assert man.files[rel]["size"] == (src / name).stat().st_size
    assert r.assets == ["config.json", "generation_config.json"]
    assert sorted(man.files) == sorted([".metadata", "__0_0.distcp", "__1_0.distcp",
                                        "__2_0.distcp", *man.config["hf_assets"].values()])


def test_keep_dtype_is_byte_exact(models, tmp_path):
    import torch

    src = models[(False, "bfloat16", True)]
    r = import_hf(src, tmp_path / "ck", world_size=3, dtype="keep")
    assert r.dtypes == {} and r.bytes == r.bytes_read
    got = load_tensors(tmp_path / "ck")
    for name, t in hf_weights(src).items():
        assert got[f"model.{name}"].dtype == torch.bfloat16
        assert torch.equal(got[f"model.{name}"], t), name


def _write_safetensors(path: Path, tensors: dict, header_patch=None, *, raw_header=None) -> Path:
    """A .safetensors file written by hand (so tests can break its header on purpose)."""
    import torch

    header, blobs, pos = {}, [], 0
    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.float64: "F64"}
    for name, t in tensors.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    if header_patch:
        header_patch(header)
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def test_single_file_odd_shapes_and_dtypes(tmp_path):
    import torch

    g = torch.Generator().manual_seed(1)
    tensors = {"scalar": torch.tensor(3.5), "few_rows": torch.randn(2, 3, generator=g),
               "half": torch.randn(7, 5, generator=g).half(),
               "bf": torch.randn(9, generator=g).bfloat16(),
               "ids": torch.arange(10, dtype=torch.int64).reshape(5, 2),
               "dbl": torch.randn(6, 2, generator=g, dtype=torch.float64)}
    src = _write_safetensors(tmp_path / "w.safetensors", tensors)
    r = import_hf(src, tmp_path / "ck", world_size=4)
    assert r.dtypes == {"bfloat16": "float32", "float16": "float32", "float64": "float32"}
    got = load_tensors(tmp_path / "ck")
    for name, t in tensors.items():
        want = t if t.dtype == torch.int64 else t.float()
        assert got[f"model.{name}"].dtype == want.dtype and torch.equal(got[f"model.{name}"], want)
    meta = read_metadata(Storage.open(tmp_path / "ck"))
    few = meta.tensors["model.few_rows"].chunks  # 2 rows on 4 ranks: ranks 2 and 3 are empty
    assert [(c.storage.relative_path, c.offsets, c.sizes) for c in few] == [
        ("__0_0.distcp", (0, 0), (1, 3)), ("__1_0.distcp", (1, 0), (1, 3)),
        ("__2_0.distcp", (2, 0), (0, 3))]
    assert [c.storage.relative_path for c in meta.tensors["model.scalar"].chunks] == ["__0_0.distcp"]
    assert validate(tmp_path / "ck", deep=True).ok


def test_byte_path_does_not_import_torch(models, tmp_path):
    code = ("import sys; from ckptool.ops.import_hf import import_hf; "
            f"r = import_hf({str(models[(True, 'bfloat16', True)])!r}, {str(tmp_path / 'o')!r}, "
            "world_size=2); assert r.verified; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_memory_stays_bounded(tmp_path):
    import tracemalloc

    import torch

    big = {"big": torch.arange(12 << 20, dtype=torch.float32).reshape(3 << 20, 4).bfloat16()}
    src = _write_safetensors(tmp_path / "big.safetensors", big)  # 24 MiB bf16 -> 48 MiB fp32
    del big
    tracemalloc.start()
    try:
        import_hf(src, tmp_path / "ck", world_size=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, f"peak {peak >> 20} MiB"


# ---------------------------------------------------------------------------------------------
# CLI and refusals


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["import", *args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_summary_force_and_json(models, tmp_path, capsys):
    src = str(models[(True, "bfloat16", True)])
    code, out, _ = _cli(capsys, src, str(tmp_path / "ck"), "--ranks", "2")
    assert code == 0
    assert out.startswith(f"wrote {tmp_path / 'ck'}: 2 ranks, 21 tensors (1 tied), ")
    assert "(bfloat16 -> float32)" in out and out.endswith("(verified)\n")
    code, _, err = _cli(capsys, src, str(tmp_path / "ck"), "--ranks", "3")
    assert code == 1
    assert err == (f"error: {tmp_path / 'ck'} already exists. Pass --force to replace it, or "
                   "choose another DST\n")
    code, out, _ = _cli(capsys, src, str(tmp_path / "ck"), "--ranks", "3", "--force", "--json")
    assert code == 0 and json.loads(out)["world_size"] == 3
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    main_code = subprocess.run([sys.executable, "-m", "ckptool", "validate", "--deep",
                                str(tmp_path / "ck")], capture_output=True, text=True)
    assert main_code.returncode == 0, main_code.stdout + main_code.stderr


class _Marker:
    """Unpickling this creates a file: proof that a .bin was (or was not) unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _refused(capsys, src: Path | str, dst: Path, expect: str) -> None:
    code, out, err = _cli(capsys, str(src), str(dst), "--ranks", "2")
    assert code == 1, out + err
    assert err.count("\n") == 1 and err.startswith("error: ") and expect in err, err
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp")]


def test_pickle_weights_are_refused_never_unpickled(tmp_path, capsys):
    marker = tmp_path / "unpickled"
    folder = tmp_path / "binmodel"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(str(marker))))
    (folder / "config.json").write_text("{}")
    _refused(capsys, folder, tmp_path / "out", "pytorch_model.bin is a PyTorch pickle; "
                                               "ckptool never unpickles weights")
    _refused(capsys, folder / "pytorch_model.bin", tmp_path / "out", "is a PyTorch pickle")
    index = {"metadata": {}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(capsys, folder, tmp_path / "out", "is a PyTorch pickle")
    assert not marker.exists()


def _shift(name: str, by: int):
    def patch(h):
        h[name]["data_offsets"] = [o + by for o in h[name]["data_offsets"]]
    return patch


HOSTILE = {
    "offset past end": (_shift("b", 64), "past the end of the file"),
    "overlapping": (lambda h: h["b"].__setitem__("data_offsets", [8, 8 + 4 * 6]),
                    "overlaps the tensor before it"),
    "size mismatch": (lambda h: h["a"].__setitem__("shape", [4, 4]), "needs 64"),
    "unknown dtype": (lambda h: h["a"].__setitem__("dtype", "Q7"), "unknown dtype 'Q7'"),
    "negative offset": (lambda h: h["a"].__setitem__("data_offsets", [-4, 12]), "bad data_offsets"),
    "extra field": (lambda h: h["a"].__setitem__("evil", 1), "is not a {dtype, shape, "),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused(tmp_path, capsys, case):
    import torch

    patch, expect = HOSTILE[case]
    src = _write_safetensors(tmp_path / "x.safetensors",
                             {"a": torch.ones(2, 3), "b": torch.ones(3, 2)}, patch)
    _refused(capsys, src, tmp_path / "out", expect)


def test_hostile_header_length_and_json(tmp_path, capsys):
    import torch

    src = _write_safetensors(tmp_path / "x.safetensors", {"a": torch.ones(2)})
    data = bytearray(src.read_bytes())
    data[:8] = struct.pack("<Q", len(data))  # header longer than the file
    src.write_bytes(bytes(data))
    _refused(capsys, src, tmp_path / "out", "does not fit the file")
    _write_safetensors(src, {"a": torch.ones(2)}, raw_header=b"[1, 2]")
    _refused(capsys, src, tmp_path / "out", "header is not a JSON object")


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd.safetensors",
                                   "sub/../../x.safetensors"])
def test_index_paths_are_checked(tmp_path, capsys, entry):
    import torch

    folder = tmp_path / "m"
    folder.mkdir()
    _write_safetensors(tmp_path / "outside.safetensors", {"w": torch.ones(2)})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": entry}}))
    _refused(capsys, folder, tmp_path / "out", "unsafe path")


def test_symlink_out_of_the_folder_is_refused(tmp_path, capsys):
    import torch

    folder = tmp_path / "m"
    folder.mkdir()
    _write_safetensors(tmp_path / "outside.safetensors", {"w": torch.ones(2)})
    os.symlink(tmp_path / "outside.safetensors", folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    _refused(capsys, folder, tmp_path / "out", "leads outside the folder")


def test_index_and_shards_must_agree(models, tmp_path, capsys):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(models[(False, "bfloat16", True)], folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    del index["weight_map"][name]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(capsys, folder, tmp_path / "out", f"{name} is in a shard but not in")


# ---------------------------------------------------------------------------------------------
# The Hub (real huggingface_hub client, local server)


def _run_hub(endpoint: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp / "hf_home"),
               HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "ckptool", "import", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_from_hub(models, tmp_path):
    import torch

    from hub_server import HubServer

    src = models[(True, "bfloat16", True)]
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    files["pytorch_model.bin"] = b"never fetched"
    files["README.md"] = b"# tiny\n"
    with HubServer() as hub:
        sha = hub.put_files("org/tiny", files)
        hub.put_files("org/binonly", {"pytorch_model.bin": b"x", "config.json": b"{}"})
        proc = _run_hub(hub.url, tmp_path, "org/tiny@main", str(tmp_path / "ck"), "--ranks", "2",
                        "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["source"] == f"org/tiny@{sha}"
        fetched = sorted({p.rsplit("/", 1)[-1] for m, p in hub.requests if "/resolve/" in p})
        assert fetched == sorted(n for n in files if n not in ("pytorch_model.bin", "README.md"))
        bad = _run_hub(hub.url, tmp_path, "org/binonly", str(tmp_path / "b"), "--ranks", "2")
        missing = _run_hub(hub.url, tmp_path, "org/none@main", str(tmp_path / "n"), "--ranks", "2")
        norev = _run_hub(hub.url, tmp_path, "org/tiny@nope", str(tmp_path / "r"), "--ranks", "2")
        assert not hub.unknown, hub.unknown
    local = import_hf(src, tmp_path / "local", world_size=2)
    assert local.verified
    a, b = load_tensors(tmp_path / "ck"), load_tensors(tmp_path / "local")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "ck" / "hf_assets" / "config.json").read_bytes() == files["config.json"]
    for proc, expect in ((bad, "pytorch_model.bin is a PyTorch pickle"),
                         (missing, "org/none@main: no such model repo on the Hub at"),
                         (norev, "org/tiny@nope: no such revision on the Hub")):
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and expect in proc.stderr, proc.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "n").exists()


# ---------------------------------------------------------------------------------------------
# Checkpointer.load_pretrained without a process group (FSDP2 ranks: tests/dist)


def test_load_pretrained_single_process(models, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from ckptool.checkpoint import Checkpointer

    src = models[(True, "bfloat16", True)]
    ref = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    ids = torch.arange(12).reshape(2, 6) % 67
    for path in (src, None):
        if path is None:
            import_hf(src, tmp_path / "ck", world_size=3)
            path = tmp_path / "ck"
        torch.manual_seed(7)
        model = LlamaForCausalLM(tiny_config(True))
        used = Checkpointer(tmp_path / "run").load_pretrained(model, path, tmp_dir=tmp_path)
        assert Path(used).name in ("model", "ck")
        for (n, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
            assert torch.equal(p, q), n
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckptool-pretrained-")]
