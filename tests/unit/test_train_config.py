"""What a run is given: TrainConfig validation, config files, Accelerate mapping, data order."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ckptool.cli import cli
from ckptool.errors import ConfigError, IncompatibleCheckpointError
from ckptool.train.accelerate_config import read_accelerate_config
from ckptool.train.config import TrainConfig, read_config_file
from ckptool.train.data import TokenBatches, demo_corpus
from ckptool.train.loop import lr_schedule


# -- TrainConfig ---------------------------------------------------------------------------
def test_defaults_are_the_cpu_demo():
    cfg = TrainConfig()
    assert (cfg.out, cfg.model, cfg.nproc, cfg.sharding) == ("runs/demo", "tiny", None, "full")
    assert cfg.mixed_precision is None  # bf16 on GPU, fp32 on CPU
    assert cfg.effective_seq_len() == 64
    assert cfg.model_config().num_params() == 234048


@pytest.mark.parametrize("kwargs, message", [
    ({"sharding": "zero3"}, "--sharding zero3 is not one of full, grad-op, none, hybrid"),
    ({"mixed_precision": "fp16"}, "fp16 needs loss scaling"),
    ({"activation_checkpointing": "some"}, "--activation-checkpointing some"),
    ({"steps": 0}, "--steps must be at least 1, got 0"),
    ({"keep": -1}, "--keep must not be negative"),
    ({"batch_size": 3, "nproc": 2}, "--batch-size 3 (the global batch) does not split over 2 ranks"),
    ({"seq_len": 65}, "--seq-len 65 exceeds the model's max_seq_len 64"),
    ({"resume": False, "resume_from": "x"}, "--resume-from and --no-resume contradict"),
    ({"data": "/nonexistent/file.txt"}, "--data /nonexistent/file.txt is not a file"),
    ({"vocab": 100}, "--vocab 100 is too small for byte-level tokens"),
    ({"model": "huge"}, "--model huge: unknown model size"),
])
def test_invalid_options_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_from_dict_accepts_dashes_and_rejects_unknown_keys():
    cfg = TrainConfig.from_dict({"save-every": 5, "d_model": 32, "n-heads": 2}, steps=7)
    assert (cfg.save_every, cfg.steps, cfg.model_config().d_model) == (5, 7, 32)
    with pytest.raises(ConfigError, match=r"unknown train options \['epochs'\]"):
        TrainConfig.from_dict({"epochs": 3})


def test_config_files_yaml_and_json(tmp_path):
    (tmp_path / "a.yaml").write_text("steps: 12\nsharding: grad-op\n")
    (tmp_path / "a.json").write_text(json.dumps({"steps": 12}))
    (tmp_path / "bad.yaml").write_text("- 1\n- 2\n")
    assert read_config_file(tmp_path / "a.yaml") == {"steps": 12, "sharding": "grad-op"}
    assert read_config_file(tmp_path / "a.json") == {"steps": 12}
    with pytest.raises(ConfigError, match="must hold a mapping"):
        read_config_file(tmp_path / "bad.yaml")


def test_cli_merges_file_then_command_line(tmp_path):
    # The file's batch size (3) would not split over 2 ranks; the command line's (4) does,
    # so the error that comes back is the seq-len one: the command line won.
    (tmp_path / "c.yaml").write_text("batch_size: 3\nsteps: 5\n")
    base = ["train", "--out", str(tmp_path / "run"), "--config", str(tmp_path / "c.yaml"), "--nproc", "2"]
    r = CliRunner().invoke(cli, base)
    assert r.exit_code == 2 and "Error: --batch-size 3" in r.output, r.output  # a usage error
    r = CliRunner().invoke(cli, [*base, "--batch-size", "4", "--seq-len", "999"])
    assert r.exit_code == 2 and "Error: --seq-len 999" in r.output, r.output


# -- Accelerate config ---------------------------------------------------------------------
FSDP2_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: 4
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_reshard_after_forward: false
  fsdp_offload_params: true
  fsdp_activation_checkpointing: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
"""


def test_accelerate_fsdp2_config_maps_onto_options(tmp_path):
    p = tmp_path / "acc.yaml"
    p.write_text(FSDP2_YAML)
    assert read_accelerate_config(p) == {
        "mixed_precision": "bf16", "nproc": 4, "sharding": "grad-op", "cpu_offload": True,
        "activation_checkpointing": "every",
    }


@pytest.mark.parametrize("strategy, sharding", [("FULL_SHARD", "full"), ("NO_SHARD", "none"),
                                                ("HYBRID_SHARD", "hybrid"), (2, "grad-op")])
def test_accelerate_fsdp1_strategies(tmp_path, strategy, sharding):
    p = tmp_path / "acc.yaml"
    p.write_text(f"distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n"
                 f"  fsdp_version: 1\n  fsdp_sharding_strategy: {strategy}\n")
    assert read_accelerate_config(p) == {"mixed_precision": "fp32", "sharding": sharding}


@pytest.mark.parametrize("change, message", [
    (("Block", "GPT2Block"), "fsdp_transformer_layer_cls_to_wrap GPT2Block does not name the model's block class"),
    (("SHARDED_STATE_DICT", "FULL_STATE_DICT"), "fsdp_state_dict_type FULL_STATE_DICT cannot be honoured"),
    (("mixed_precision: bf16", "mixed_precision: fp16"), "mixed_precision 'fp16' cannot be honoured"),
    (("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"), "fsdp_auto_wrap_policy SIZE_BASED_WRAP cannot be honoured"),
    (("distributed_type: FSDP", "distributed_type: DEEPSPEED"), "distributed_type 'DEEPSPEED' is not FSDP"),
    (("  fsdp_version: 2\n", "  fsdp_version: 2\n  fsdp_limit_all_gathers: true\n"),
     "unsupported key(s) fsdp_limit_all_gathers"),
])
def test_accelerate_config_rejects_what_cannot_be_honoured(tmp_path, change, message):
    p = tmp_path / "acc.yaml"
    p.write_text(FSDP2_YAML.replace(*change))
    with pytest.raises(ConfigError) as e:
        read_accelerate_config(p)
    assert message in str(e.value)


# -- data ----------------------------------------------------------------------------------
def _src(rank, ws, **kw):
    return TokenBatches.demo(seq_len=16, global_batch=8, seed=kw.get("seed", 0), rank=rank, world_size=ws)


def test_global_batch_is_the_same_at_any_world_size():
    for step, micro in [(0, 0), (5, 1), (123, 0)]:
        full = _src(0, 1).get(step, micro)
        for ws in (2, 4, 8):
            parts = [_src(r, ws).get(step, micro) for r in range(ws)]
            assert torch.equal(torch.cat([p.inputs for p in parts]), full.inputs)
            assert torch.equal(torch.cat([p.targets for p in parts]), full.targets)
        assert torch.equal(full.inputs[:, 1:], full.targets[:, :-1])


def test_batches_depend_on_seed_and_step_only():
    a, b = _src(0, 1), _src(0, 1)
    assert torch.equal(a.get(3, 0).inputs, b.get(3, 0).inputs)
    assert not torch.equal(a.get(3, 0).inputs, a.get(4, 0).inputs)
    assert not torch.equal(a.get(3, 0).inputs, _src(0, 1, seed=1).get(3, 0).inputs)
    assert demo_corpus(64) == demo_corpus(64)


def test_data_position_round_trip_and_mismatch():
    src = _src(0, 2)
    src.position = 17
    other = _src(1, 2)
    other.load_state_dict(src.state_dict())
    assert other.position == 17
    with pytest.raises(IncompatibleCheckpointError, match="data seed is 0 but this run's is 1"):
        _src(0, 2, seed=1).load_state_dict(src.state_dict())


def test_text_file_data(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"hello world " * 10)
    src = TokenBatches.from_file(p, seq_len=8, global_batch=2, seed=0, rank=0, world_size=1)
    assert src.get(0, 0).inputs.max() < 256
    p.write_bytes(b"short")
    with pytest.raises(ConfigError, match="too few for --seq-len 8"):
        TokenBatches.from_file(p, seq_len=8, global_batch=2, seed=0, rank=0, world_size=1)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    f = lr_schedule(10, 100)
    assert f(0) < f(5) < f(9) <= 1.0
    assert f(10) == pytest.approx(1.0)
    assert f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
