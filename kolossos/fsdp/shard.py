"""Apply FSDP2 to a model as a :class:`TorchFSDPConfig` says, in a fixed order.

1. ``sync_module_states``: broadcast parameters and buffers from the first data-parallel rank;
2. ``buffer_dtype``: convert floating-point buffers;
3. ``fully_shard`` every unit (:func:`kolossos.fsdp.wrap.plan_units`), descendants first, then the
   root, with the mesh, reshard policy, mixed precision and offload policy of the config;
4. prefetch settings;
5. a model built on the meta device is materialised (``to_empty``) and initialised.

The model is changed in place: its parameters become ``DTensor`` shards (new ``Parameter``
objects; optimizers must be pointed at them, see :func:`kolossos.fsdp.optimizer.rebind_params`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.fsdp.config import TorchFSDPConfig
from kolossos.fsdp.wrap import Unit, plan_units
from kolossos.lazy import lazy_named_tensors, replay_tensors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["broadcast_module_states", "no_gradient_sync", "shard_model"]

_log = logging.getLogger("kolossos.fsdp")


def broadcast_module_states(
    model: nn.Module, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Copy every parameter and buffer of the group's first rank to the others (collective)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            wire = tensor.detach().to(device)  # NCCL needs device tensors; gloo takes CPU ones
            dist.broadcast(wire, src=src, group=group)
            if wire is not tensor:
                tensor.copy_(wire)


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, name, buffer.to(dtype))


def _policies(config: TorchFSDPConfig) -> tuple[Any, Any, Any]:
    """Mixed-precision policies for (ordinary units, fp32 units, the root)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    unit = MixedPrecisionPolicy(
        param_dtype=config.param_dtype,
        reduce_dtype=config.reduce_dtype,
        cast_forward_inputs=config.cast_forward_inputs,
    )
    full = (
        MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        if config.param_dtype is not None
        else unit
    )
    root = MixedPrecisionPolicy(
        param_dtype=config.param_dtype,
        reduce_dtype=config.reduce_dtype,
        output_dtype=config.output_dtype,
        cast_forward_inputs=config.cast_forward_inputs,
    )
    return unit, full, root


def _offload_policy(config: TorchFSDPConfig, device: torch.device) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not config.offload_params:
        return OffloadPolicy()
    if device.type == "cpu":
        # Without an accelerator everything already lives in CPU memory, and FSDP2's policy
        # would only add pinned-memory allocations, which fail without an accelerator.
        _log.info("cpu_offload has no effect without an accelerator: states are in CPU memory.")
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=True)


def _set_prefetch(units: list[Unit], config: TorchFSDPConfig) -> None:
    if not config.forward_prefetch:
        return
    inside = {id(m) for u in units for m in u.module.modules() if m is not u.module}
    top = [u.module for u in units if id(u.module) not in inside]  # in forward order
    for current, following in itertools.pairwise(top):
        current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]


def _fill_lazy(
    model: nn.Module, lazy: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> None:
    """Give the (allocated, sharded) states of a lazily built model their values: replay the
    construction once and copy this rank's shard of each full value (COLLECTIVE: every rank
    uses rank 0's random states, so the values equal an eager build broadcast from rank 0)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = [_state(model, name) for name, _ in lazy]

    def receive(index: int, full: torch.Tensor) -> None:
        target = targets[index]
        with torch.no_grad():
            if isinstance(target, DTensor):
                mine = distribute_tensor(
                    full, target.device_mesh, target.placements, src_data_rank=None
                )
                target.to_local().copy_(mine.to_local())
            else:
                target.copy_(full)

    replay_tensors([t for _, t in lazy], receive, group)


def _state(model: nn.Module, name: str) -> torch.Tensor:
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    tensor = getattr(owner, attr)
    assert isinstance(tensor, torch.Tensor), name
    return tensor


def _materialise(
    model: nn.Module,
    config: TorchFSDPConfig,
    device: torch.device,
    lazy: list[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None,
) -> None:
    """Allocate a meta-device model's (sharded) states and initialise them: from the record of
    a lazily built model, else with ``param_init_fn`` or each module's ``reset_parameters``."""
    real = {  # to_empty re-allocates every state; a lazy model's real ones are kept
        name: t.detach().clone()
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
        if lazy and not t.is_meta
    }
    model.to_empty(device=torch.device("cpu") if config.offload_params else device)
    with torch.no_grad():
        for name, value in real.items():
            target = _state(model, name)
            (target.to_local() if hasattr(target, "to_local") else target).copy_(value)
    if lazy:
        if config.param_init_fn is not None:
            _log.warning("param_init_fn is not called for a lazily built model: it is replayed.")
        _fill_lazy(model, lazy, group)
        return
    if config.param_init_fn is not None:
        config.param_init_fn(model)
        return
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def shard_model(
    model: nn.Module,
    config: TorchFSDPConfig,
    mesh: DeviceMesh,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> list[Unit]:
    """Apply FSDP2 to ``model`` in place (collective); returns the units, root excluded.

    Raises:
        ValueError: ``sync_module_states`` with meta-device parameters (nothing to broadcast).
    """
    from torch.distributed.fsdp import fully_shard

    meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    lazy = list(lazy_named_tensors(model))  # the records survive fully_shard's new parameters
    if config.sync_module_states and lazy:
        _log.info("sync_module_states: a lazily built model is replayed with rank 0's seed.")
    elif config.sync_module_states:
        if meta:
            raise ValueError(
                "sync_module_states=True needs materialised parameters on every rank, but the "
                "model is on the meta device; param_init_fn runs on every rank with the same seed."
            )
        broadcast_module_states(model, group, device)  # sync point
    if config.param_init_fn is not None and not meta:
        _log.warning("param_init_fn is only used for models built on the meta device; not called.")
    if config.buffer_dtype is not None:
        _cast_buffers(model, config.buffer_dtype)
    ignored = {p for m in config.ignored_modules for p in m.parameters()}
    ignored.update(config.ignored_params)
    for module in config.ignored_modules:  # FSDP neither shards nor moves them
        module.to(device)
    for param in config.ignored_params:
        param.data = param.data.to(device)
    units = plan_units(
        model,
        config.auto_wrap_policy,
        config.ignored_modules,
        config.ignored_params,
        config.fp32_module_classes,
    )
    unit_mp, fp32_mp, root_mp = _policies(config)
    common = {
        "mesh": mesh,
        "offload_policy": _offload_policy(config, device),
        "ignored_params": ignored or None,
    }
    for unit in reversed(units):  # bottom-up: descendants before ancestors
        fully_shard(
            unit.module,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=fp32_mp if unit.fp32 else unit_mp,
            **common,
        )
    # The root's parameters are needed first in backward: FSDP2 keeps them after forward
    # (None) unless the strategy never reshards.
    fully_shard(
        model,
        reshard_after_forward=None if config.reshard_after_forward else False,
        mp_policy=root_mp,
        **common,
    )
    _set_prefetch(units, config)
    if meta:
        _materialise(model, config, device, lazy, group)
    return units


@contextlib.contextmanager
def no_gradient_sync(root: nn.Module) -> Iterator[None]:
    """Inside, backward passes accumulate unsharded gradients locally, with no reduce-scatter or
    all-reduce; the first backward after it reduces everything accumulated (FSDP1's ``no_sync``).

    Raises:
        TypeError: ``root`` is not an FSDP2 module.
    """
    setter = getattr(root, "set_requires_gradient_sync", None)
    if not callable(setter):
        raise TypeError(f"no_sync needs a fully_shard module, not {type(root).__name__}.")
    setter(False)
    try:
        yield
    finally:
        setter(True)
