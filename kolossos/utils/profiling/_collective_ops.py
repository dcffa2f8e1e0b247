"""Which dispatcher operators are collectives, of what kind, and how many bytes each one carries.

Every ``torch.distributed`` collective reaches the dispatcher as an operator of the ``c10d``
namespace (the eager API, and the C++ callers of ``ProcessGroup`` such as DDP's reducer) or of
``_c10d_functional`` (functional collectives: DTensor, tensor parallelism, ``torch.compile``).
The byte convention: the logical data the collective works on, i.e. the tensor of an all-reduce
or broadcast, the whole input of a reduce-scatter or all-to-all, the gathered output of an
all-gather, the tensors of a send or receive.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OpSpec:
    """How to read one collective operator."""

    kind: str
    """collective kind: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ..."""
    payload: str | None
    """name of the schema argument holding the data (``None``: no payload, e.g. a barrier)"""
    times_group_size: bool = False
    """the payload is one rank's input of a gather: multiply by the group size"""


_C10D: dict[str, OpSpec] = {
    "allreduce_": OpSpec("all_reduce", "tensors"),
    "allreduce_coalesced_": OpSpec("all_reduce", "tensors"),
    "_allgather_base_": OpSpec("all_gather", "output_tensor"),
    "allgather_": OpSpec("all_gather", "output_tensors"),
    "allgather_coalesced_": OpSpec("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": OpSpec("all_gather", "outputs"),
    "_reduce_scatter_base_": OpSpec("reduce_scatter", "input_tensor"),
    "reduce_scatter_": OpSpec("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": OpSpec("reduce_scatter", "inputs"),
    "broadcast_": OpSpec("broadcast", "tensors"),
    "reduce_": OpSpec("reduce", "tensors"),
    "gather_": OpSpec("gather", "input_tensors", times_group_size=True),
    "scatter_": OpSpec("scatter", "output_tensors", times_group_size=True),
    "alltoall_": OpSpec("all_to_all", "input_tensors"),
    "alltoall_base_": OpSpec("all_to_all", "input"),
    "send": OpSpec("send", "tensors"),
    "recv_": OpSpec("recv", "tensors"),
    "recv_any_source_": OpSpec("recv", "tensors"),
    "barrier": OpSpec("barrier", None),
    "monitored_barrier_": OpSpec("barrier", None),
}

_FUNCTIONAL: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", "input"),
    "all_reduce_": OpSpec("all_reduce", "input"),
    "all_reduce_coalesced": OpSpec("all_reduce", "inputs"),
    "all_reduce_coalesced_": OpSpec("all_reduce", "inputs"),
    "all_gather_into_tensor": OpSpec("all_gather", "input", times_group_size=True),
    "all_gather_into_tensor_out": OpSpec("all_gather", "input", times_group_size=True),
    "all_gather_into_tensor_coalesced": OpSpec("all_gather", "inputs", times_group_size=True),
    "reduce_scatter_tensor": OpSpec("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": OpSpec("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": OpSpec("reduce_scatter", "inputs"),
    "all_to_all_single": OpSpec("all_to_all", "input"),
    "broadcast": OpSpec("broadcast", "input"),
    "broadcast_": OpSpec("broadcast", "input"),
    "isend": OpSpec("send", "tensor"),
    "irecv": OpSpec("recv", "tensor"),
}

NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL}


@dataclass(frozen=True)
class Record:
    """One collective call as seen by the dispatcher."""

    kind: str
    nbytes: int
    group: Any
    """the ``ProcessGroup`` it ran on (``None`` where it could not be resolved)"""


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _resolve_group(value: Any) -> Any:
    """A ``ProcessGroup`` from the schema's group argument (script object, name, or group)."""
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return value
    if isinstance(value, str):
        from torch._C._distributed_c10d import _resolve_process_group

        try:
            return _resolve_process_group(value)  # type: ignore[arg-type]
        except RuntimeError:  # a name that is not registered (destroyed group)
            return None
    if isinstance(value, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(value)
        except (RuntimeError, TypeError):
            return None
    return None


def _bind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _p2p_records(bound: dict[str, Any], group: Any) -> Iterable[Record]:
    for op, tensor in zip(bound.get("op_list", ()), bound.get("tensors", ()), strict=False):
        kind = "send" if "send" in str(op) else "recv"
        yield Record(kind, _tensor_bytes(tensor), group)


def records_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Record]:
    """The collective calls one dispatcher operator represents (empty for other operators)."""
    table = NAMESPACES.get(func.namespace)
    if table is None:
        return []
    name = func._schema.name.split("::", 1)[1]
    bound = _bind(func, args, kwargs)
    group = _resolve_group(bound.get("process_group", bound.get("group_name")))
    if name == "batch_p2p_ops":
        return list(_p2p_records(bound, group))
    spec = table.get(name)
    if spec is None:  # wait_tensor, autograd wrappers, check_for_nan: not communication
        return []
    nbytes = _tensor_bytes(bound.get(spec.payload)) if spec.payload else 0
    if spec.times_group_size:
        size = bound.get("group_size")
        if size is None:
            size = group.size() if group is not None else 1
        nbytes *= int(size)
    return [Record(spec.kind, nbytes, group)]
