"""Reading an Accelerate FSDP config file into ``TrainConfig`` options.

Owns the mapping from ``accelerate config`` YAML (``fsdp_config`` keys and the top-level
``mixed_precision``/``num_processes``) onto ckptool's settings. Only the file is read (pyyaml),
never Accelerate's runtime. A key or value that ckptool cannot honour is a ``ConfigError``
naming it, never silently ignored; keys that only tune Accelerate internals with no effect
here are listed in ``IGNORED``.
"""

from __future__ import annotations

import os
from typing import Any

from ckptool.errors import ConfigError
from ckptool.train.config import read_config_file

STRATEGIES = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad-op", "NO_SHARD": "none",
              "HYBRID_SHARD": "hybrid"}
#: Accelerate (FSDP1) also numbers the strategies 1..5.
STRATEGY_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                    "5": "HYBRID_SHARD_ZERO2"}
#: Top-level keys with no bearing on an FSDP run on one node, and fsdp_config keys whose
#: every value is what FSDP2 in ckptool does anyway.
IGNORED = {
    "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids", "machine_rank",
    "main_process_ip", "main_process_port", "main_training_function", "rdzv_backend", "same_network",
    "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "dynamo_config",
    "fsdp_sync_module_states", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
    "fsdp_backward_prefetch", "fsdp_min_num_params",
}


def _fail(path: str, what: str, hint: str) -> ConfigError:
    return ConfigError(f"{path}: {what}", path=path, hint=hint)


def _bool(path: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")
    raise _fail(path, f"{key} must be true or false, got {value!r}", "Fix the value in the file")


def _sharding(path: str, key: str, value: Any) -> str:
    if isinstance(value, bool):  # FSDP2 style: fsdp_reshard_after_forward: true|false
        return "full" if value else "grad-op"
    name = STRATEGY_NUMBERS.get(str(value), str(value).upper())
    if name in STRATEGIES:
        return STRATEGIES[name]
    raise _fail(path, f"{key} {value!r} cannot be honoured",
                "Use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD (HYBRID_SHARD_ZERO2 is not supported)")


def _top_level(path: str, data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dist_type = data.get("distributed_type", "FSDP")
    if str(dist_type).upper() != "FSDP":
        raise _fail(path, f"distributed_type {dist_type!r} is not FSDP",
                    "ckptool train runs FSDP2; set distributed_type: FSDP")
    mp = str(data.get("mixed_precision", "no")).lower()
    if mp not in ("no", "bf16"):
        raise _fail(path, f"mixed_precision {mp!r} cannot be honoured",
                    "Use bf16 or no (fp16 needs loss scaling, which ckptool train does not do)")
    out["mixed_precision"] = "bf16" if mp == "bf16" else "fp32"
    if int(data.get("num_machines", 1)) != 1:
        raise _fail(path, f"num_machines {data['num_machines']} is more than one",
                    "Start each node with 'accelerate launch' or torchrun; ckptool train joins them")
    if "num_processes" in data:
        out["nproc"] = int(data["num_processes"])
    return out


def _fsdp(path: str, fsdp: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    version = int(fsdp.get("fsdp_version", 2))
    if version not in (1, 2):
        raise _fail(path, f"fsdp_version {version} is unknown", "Use 2 (ckptool always runs FSDP2)")
    for key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
        if key in fsdp:
            out["sharding"] = _sharding(path, key, fsdp[key])
    policy = str(fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise _fail(path, f"fsdp_auto_wrap_policy {policy} cannot be honoured",
                    "ckptool wraps each transformer block; use TRANSFORMER_BASED_WRAP with Block")
    classes = [c.strip() for c in str(fsdp.get("fsdp_transformer_layer_cls_to_wrap", "Block")).split(",")]
    if classes != ["Block"]:
        raise _fail(path, f"fsdp_transformer_layer_cls_to_wrap {','.join(classes)} does not name the "
                    "model's block class", "The built-in model's repeating unit is Block")
    state_dict_type = str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT")).upper()
    if state_dict_type != "SHARDED_STATE_DICT":
        raise _fail(path, f"fsdp_state_dict_type {state_dict_type} cannot be honoured",
                    "ckptool saves sharded DCP checkpoints; use SHARDED_STATE_DICT and "
                    "'ckptool consolidate' for one file")
    if _bool(path, "fsdp_forward_prefetch", fsdp.get("fsdp_forward_prefetch", False)):
        raise _fail(path, "fsdp_forward_prefetch true cannot be honoured", "Set it to false")
    if "fsdp_offload_params" in fsdp:
        out["cpu_offload"] = _bool(path, "fsdp_offload_params", fsdp["fsdp_offload_params"])
    if "fsdp_activation_checkpointing" in fsdp:
        ac = _bool(path, "fsdp_activation_checkpointing", fsdp["fsdp_activation_checkpointing"])
        out["activation_checkpointing"] = "every" if ac else "none"
    return out


KNOWN_FSDP = {"fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy",
              "fsdp_transformer_layer_cls_to_wrap", "fsdp_state_dict_type", "fsdp_forward_prefetch",
              "fsdp_offload_params", "fsdp_activation_checkpointing"}
KNOWN_TOP = {"distributed_type", "mixed_precision", "num_machines", "num_processes", "fsdp_config"}


def read_accelerate_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``TrainConfig`` options from an Accelerate config file.

    Args:
        path: the YAML (or JSON) written by ``accelerate config``.

    Returns:
        A dict of ``TrainConfig`` field names to values (``sharding``, ``mixed_precision``,
        ``cpu_offload``, ``activation_checkpointing``, ``nproc``), only for keys present.

    Raises:
        ConfigError: a key or value ckptool cannot honour (named in the message).

    Example:
        >>> read_accelerate_config("fsdp.yaml")
        {'mixed_precision': 'bf16', 'sharding': 'full', 'cpu_offload': False}
    """
    p = os.fspath(path)
    data = read_config_file(p)
    fsdp = data.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise _fail(p, "fsdp_config must be a mapping", "Fix the file or regenerate it with 'accelerate config'")
    unknown = sorted((set(data) - KNOWN_TOP - IGNORED) | (set(fsdp) - KNOWN_FSDP - IGNORED))
    if unknown:
        raise _fail(p, f"unsupported key(s) {', '.join(unknown)}",
                    "Remove them; ckptool maps only the FSDP settings it can honour")
    return {**_top_level(p, data), **_fsdp(p, fsdp)}
