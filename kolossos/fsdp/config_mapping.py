"""From Colossal-AI's ``TorchFSDPPlugin`` arguments (FSDP1's vocabulary) to a ``TorchFSDPConfig``.

FSDP1 enums and classes (``ShardingStrategy``, ``CPUOffload``, ``BackwardPrefetch``,
``MixedPrecision``) are accepted, and so are their member names as strings and the FSDP2
counterparts (``CPUOffloadPolicy``, ``MixedPrecisionPolicy``). Every argument is mapped onto FSDP2
or rejected with an error naming it; ``docs/fsdp.md`` has the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.accelerator import get_accelerator
from kolossos.amp import LossScalePolicy
from kolossos.fsdp.config import PRECISIONS, SHARDING_MODES, TorchFSDPConfig

__all__ = ["FSDP1_EXTRA_KWARGS", "build_config"]

#: FSDP1 constructor arguments beyond Colossal-AI's nine that the plugin also takes
FSDP1_EXTRA_KWARGS = (
    "device_id",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
    "device_mesh",
)
_DTYPE_PRECISION = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    None: "fp32",
}


def _sharding(value: Any) -> str:
    if value is None:
        return "FULL_SHARD"
    name = getattr(value, "name", value)  # ShardingStrategy member or its name
    if isinstance(name, str) and name.upper() in {s.upper() for s in SHARDING_MODES}:
        return next(s for s in SHARDING_MODES if s.upper() == name.upper())
    raise ValueError(
        f"sharding_strategy={value!r} is not a torch.distributed.fsdp.ShardingStrategy; use one of "
        f"{', '.join(SHARDING_MODES)} (the enum member or its name)."
    )


def _offload(value: Any) -> bool:
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy

    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, CPUOffload):
        return bool(value.offload_params)
    if isinstance(value, CPUOffloadPolicy):
        return True
    raise TypeError(
        f"cpu_offload={value!r} must be None, a bool, CPUOffload(offload_params=...) or "
        "CPUOffloadPolicy()."
    )


def _backward_prefetch(value: Any) -> bool:
    name = getattr(value, "name", value)
    if value is None or (isinstance(name, str) and name.upper() == "BACKWARD_PRE"):
        return True
    if isinstance(name, str) and name.upper() == "BACKWARD_POST":
        raise NotImplementedError(
            "backward_prefetch=BACKWARD_POST has no FSDP2 equivalent: FSDP2 issues the next "
            "unit's all-gather when the current unit's backward starts (BACKWARD_PRE). Pass "
            "BACKWARD_PRE or None."
        )
    raise ValueError(
        f"backward_prefetch={value!r} must be None or a torch.distributed.fsdp.BackwardPrefetch."
    )


def _mixed_precision(precision: str, mixed_precision: Any) -> dict[str, Any]:
    """Config fields for ``precision=`` together with ``mixed_precision=``."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(PRECISIONS)}.")
    if isinstance(mixed_precision, str):  # the precision name, as Booster(mixed_precision=) takes
        if precision not in ("fp32", mixed_precision):
            raise ValueError(
                f"precision={precision!r} and mixed_precision={mixed_precision!r} disagree."
            )
        precision, mixed_precision = mixed_precision, None
        if precision not in PRECISIONS:
            raise ValueError(f"mixed_precision={precision!r} must be one of {PRECISIONS}.")
    if mixed_precision is None:
        if precision == "fp32":
            return {"precision": "fp32"}
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        # Gradients are reduced in fp32 and the loss is computed from fp32 outputs, as autocast
        # would: only the parameters' all-gather and the module math run in low precision.
        return {
            "precision": precision,
            "param_dtype": dtype,
            "reduce_dtype": torch.float32,
            "output_dtype": torch.float32,
        }
    if isinstance(mixed_precision, MixedPrecision):
        if mixed_precision.keep_low_precision_grads:
            raise NotImplementedError(
                "MixedPrecision(keep_low_precision_grads=True) has no FSDP2 equivalent: sharded "
                "gradients always have the sharded parameters' dtype. Drop the flag."
            )
        fields: dict[str, Any] = {
            "param_dtype": mixed_precision.param_dtype,
            "reduce_dtype": mixed_precision.reduce_dtype,
            "buffer_dtype": mixed_precision.buffer_dtype,
            "cast_forward_inputs": bool(
                mixed_precision.cast_forward_inputs or mixed_precision.cast_root_forward_inputs
            ),
        }
        if mixed_precision.param_dtype is not None:
            fields["fp32_module_classes"] = tuple(mixed_precision._module_classes_to_ignore)
    elif isinstance(mixed_precision, MixedPrecisionPolicy):
        fields = {
            "param_dtype": mixed_precision.param_dtype,
            "reduce_dtype": mixed_precision.reduce_dtype,
            "output_dtype": mixed_precision.output_dtype,
            "cast_forward_inputs": mixed_precision.cast_forward_inputs,
        }
    else:
        raise TypeError(
            f"mixed_precision={mixed_precision!r} must be None, 'fp32'/'bf16'/'fp16', "
            "torch.distributed.fsdp.MixedPrecision or MixedPrecisionPolicy."
        )
    implied = _DTYPE_PRECISION.get(fields["param_dtype"])
    if implied is None:
        raise ValueError(f"mixed_precision param_dtype={fields['param_dtype']} is not supported.")
    if precision not in ("fp32", implied):
        raise ValueError(
            f"precision={precision!r} disagrees with mixed_precision's param_dtype="
            f"{fields['param_dtype']}; pass one of them."
        )
    fields["precision"] = implied
    return fields


def _ignored(modules: Iterable[Any] | None, states: Iterable[Any] | None) -> dict[str, Any]:
    if modules is not None and states is not None:
        raise ValueError("pass ignored_modules or ignored_states, not both (as FSDP1 requires).")
    for name, value in (("ignored_modules", modules), ("ignored_states", states)):
        if value is not None and (isinstance(value, (str, bytes)) or not _iterable(value)):
            raise TypeError(
                f"{name}={value!r} must be None or a list of modules (or parameters, for "
                "ignored_states)."
            )
    mods = list(modules or ())
    params: list[nn.Parameter] = []
    for item in states or ():
        if isinstance(item, nn.Parameter):
            params.append(item)
        elif isinstance(item, nn.Module):
            mods.append(item)
        else:
            raise TypeError(f"ignored_states holds a {type(item).__name__}: pass modules/params.")
    return {"ignored_modules": tuple(mods), "ignored_params": tuple(params)}


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _check_wrap_policy(policy: Any) -> None:
    """What :mod:`kolossos.fsdp.wrap` accepts, checked before any collective."""
    from torch.distributed.fsdp.wrap import _Policy

    if policy is None or isinstance(policy, _Policy):
        return
    if isinstance(policy, (set, frozenset, list, tuple)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"auto_wrap_policy holds {bad!r}; a collection holds Module classes.")
        return
    if not callable(policy) or isinstance(policy, type):
        raise TypeError(
            f"auto_wrap_policy={policy!r} must be None, a set of Module classes, an FSDP1 policy "
            "(ModuleWrapPolicy, CustomPolicy) or a callable(module, recurse, nonwrapped_numel)."
        )


def _check_process_group(process_group: Any, device_mesh: Any, sharding: str) -> None:
    if process_group is not None and device_mesh is not None:
        raise ValueError("pass process_group or device_mesh, not both.")
    hybrid = sharding in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    if isinstance(process_group, tuple):
        if not hybrid or len(process_group) != 2:
            raise ValueError(
                "process_group as a tuple means (shard_group, replicate_group) and needs "
                "sharding_strategy=HYBRID_SHARD or _HYBRID_SHARD_ZERO2."
            )
        if not all(isinstance(g, dist.ProcessGroup) for g in process_group):
            raise TypeError("process_group=(shard_group, replicate_group) must hold ProcessGroups.")
    elif process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group={process_group!r} must be a ProcessGroup or None.")
        if hybrid:
            raise ValueError(
                f"sharding_strategy={sharding} with one process_group: pass "
                "process_group=(shard_group, replicate_group) or a 2-D device_mesh, or None to "
                "shard within each node and replicate across nodes."
            )


def _check_device_id(device_id: Any) -> None:
    own = get_accelerator().get_current_device()
    is_index = isinstance(device_id, int) and not isinstance(device_id, bool)
    wanted = torch.device("cuda", device_id) if is_index else torch.device(device_id)
    if wanted.type != own.type or (None not in (wanted.index, own.index) and wanted != own):
        raise ValueError(
            f"device_id={device_id!r} differs from this process's device {own}; the plugin "
            "uses the accelerator's current device (kolossos.launch sets it per local rank)."
        )


def _extras(extra: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(extra) - set(FSDP1_EXTRA_KWARGS))
    if unknown:
        raise TypeError(
            f"TorchFSDPPlugin got unexpected keyword argument(s) {', '.join(unknown)}; the FSDP1 "
            f"arguments it also takes are {', '.join(FSDP1_EXTRA_KWARGS)}."
        )
    if extra.get("use_orig_params", True) is not True:
        raise NotImplementedError(
            "use_orig_params=False (flat parameters) has no FSDP2 equivalent: FSDP2 always "
            "exposes the original parameters, as DTensor shards. Drop the argument."
        )
    if not isinstance(extra.get("limit_all_gathers", True), bool):
        raise TypeError("limit_all_gathers must be True or False.")
    device_id = extra.get("device_id")
    if device_id is not None:
        _check_device_id(device_id)
    return {
        "forward_prefetch": extra.get("forward_prefetch", False),
        "device_mesh": extra.get("device_mesh"),
    }


def build_config(
    process_group: Any = None,
    sharding_strategy: Any = None,
    cpu_offload: Any = None,
    auto_wrap_policy: Any = None,
    backward_prefetch: Any = None,
    mixed_precision: Any = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    *,
    precision: str = "fp32",
    checkpoint_format: str = "hf",
    loss_scale: LossScalePolicy | None = None,
    **extra: Any,
) -> TorchFSDPConfig:
    """Validate the plugin's arguments and map them onto FSDP2 (no collective is run).

    Args:
        process_group ... sync_module_states: Colossal-AI's (FSDP1's) arguments.
        precision: ``fp32``, ``bf16`` or ``fp16``.
        checkpoint_format: ``hf`` or ``dcp`` (what sharded saves write).
        loss_scale: the fp16 loss-scale policy (default: :class:`~kolossos.amp.LossScalePolicy`).
        **extra: further FSDP1 arguments (:data:`FSDP1_EXTRA_KWARGS`).

    Raises:
        TypeError / ValueError: a bad value, naming the argument.
        NotImplementedError: an FSDP1 feature FSDP2 cannot express, naming the argument.

    Example:
        >>> from torch.distributed.fsdp import ShardingStrategy
        >>> cfg = build_config(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, precision="bf16")
        >>> cfg.reshard_after_forward, cfg.param_dtype, cfg.reduce_dtype
        (False, torch.bfloat16, torch.float32)
    """
    extras = _extras(extra)
    sharding = _sharding(sharding_strategy)
    _check_wrap_policy(auto_wrap_policy)
    _check_process_group(process_group, extras["device_mesh"], sharding)
    return TorchFSDPConfig(
        sharding=sharding,
        process_group=process_group,
        offload_params=_offload(cpu_offload),
        auto_wrap_policy=auto_wrap_policy,
        backward_prefetch=_backward_prefetch(backward_prefetch),
        param_init_fn=param_init_fn,
        sync_module_states=sync_module_states,
        checkpoint_format=checkpoint_format,
        **extras,
        **_mixed_precision(precision, mixed_precision),
        **_ignored(ignored_modules, extra.get("ignored_states")),
        loss_scale=loss_scale if loss_scale is not None else LossScalePolicy(),
    )
