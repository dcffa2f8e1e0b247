"""ColoParameters (DTensor parameters) under Gemini.

Gemini keeps plain tensors in its chunks. Before the chunks are built, every DTensor parameter
is replaced by a plain ``nn.Parameter`` holding this rank's piece (``to_local()``):

* on a one-rank mesh (``ColoInitContext(default_pg=ProcessGroup(tp_degree=1))``, the documents'
  GPT-2 Gemini example with its default ``--tp_degree 1``) the piece is the whole tensor and
  the module reads the plain parameter as before;
* on a tensor-parallel mesh the module's class is swapped for a subclass whose attribute of that
  name returns ``ColoTensor.from_torch_tensor(piece, spec)`` (a DTensor view of the piece with
  the parameter's specs) on every read, so the model still
  computes with DTensors (and their sharding propagation) while Gemini manages the pieces. The
  chunks are then data-parallel over the ColoParameters' ``ProcessGroup.dp_process_group()``,
  which :func:`prepare_dtensor_params` returns for ``GeminiDDP`` to use. Gradients reach the
  pieces through ``from_local``'s backward (a replicated parameter's partial gradient is
  all-reduced over the tp group there).

Tied parameters stay tied (one plain parameter per DTensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from kolossos.tensor import ColoTensor, ColoTensorSpec, ProcessGroup

__all__ = ["prepare_dtensor_params", "tp_full_state_dict"]


@dataclass(frozen=True)
class _Layout:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    #: the ColoParameter's process group and specs: reads are ColoTensors again, so that the
    #: compute-spec output rule (replicate outputs unless set_output_replicate(False)) applies
    spec: ColoTensorSpec


def _reader(name: str) -> property:
    def get(self: nn.Module) -> Any:
        piece = self._parameters[name]
        assert piece is not None
        layout: _Layout = self.__dict__["_gemini_dtensor_layouts"][name]
        return ColoTensor.from_torch_tensor(piece, layout.spec)

    return property(get)


def _read_as_dtensor(module: nn.Module, layouts: dict[str, _Layout]) -> None:
    module.__dict__["_gemini_dtensor_layouts"] = layouts
    base = type(module)
    attrs = {name: _reader(name) for name in layouts}
    module.__class__ = type(base.__name__, (base,), attrs)


def _process_group_of(param: DTensor, name: str) -> ProcessGroup:
    pg = param._pg if isinstance(param, ColoTensor) else None
    if pg is None:
        raise NotImplementedError(
            f"parameter {name} is a tensor-parallel DTensor without a kolossos ProcessGroup; "
            "GeminiDDP takes tensor-parallel ColoParameters (built under ColoInitContext("
            "default_pg=ProcessGroup(...)) or ColoParameter(..., spec=ColoTensorSpec(pg)))."
        )
    return pg


def prepare_dtensor_params(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> dist.ProcessGroup | None:
    """Replace DTensor parameters by plain pieces (module doc); in place.

    Args:
        module: the model GeminiDDP wraps.
        process_group: the data-parallel group the caller asked for (``None``: default).

    Returns:
        Gemini's group: the data-parallel group of the tensor-parallel ColoParameters when there
        are any, else ``process_group``.

    Raises:
        NotImplementedError: a tensor-parallel DTensor that is not a ColoParameter.
        ValueError: tensor-parallel ColoParameters on different ProcessGroup layouts, or a
            ``process_group`` other than their dp group.
    """
    if not isinstance(module, nn.Module):
        return process_group
    plain: dict[int, nn.Parameter] = {}
    groups: dict[tuple[int, int], ProcessGroup] = {}
    for mod_name, sub in list(module.named_modules()):
        layouts: dict[str, _Layout] = {}
        for name, param in list(sub._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            if param.device_mesh.size() > 1:
                pg = _process_group_of(param, f"{mod_name}.{name}")
                assert isinstance(param, ColoTensor)
                groups[(pg.tp_world_size(), pg.dp_world_size())] = pg
                spec = ColoTensorSpec(pg, param.dist_spec, param.compute_spec)
                layouts[name] = _Layout(
                    param.device_mesh, tuple(param.placements), param.shape, param.stride(), spec
                )
            if id(param) not in plain:
                local = param.to_local().detach()
                plain[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            sub._parameters[name] = plain[id(param)]
        if layouts:
            _read_as_dtensor(sub, layouts)
    if len(groups) > 1:
        raise ValueError(
            f"tensor-parallel ColoParameters on several ProcessGroup layouts {sorted(groups)} "
            "(tp, dp); GeminiDDP needs one data-parallel group: use one ProcessGroup."
        )
    if not groups:
        return process_group
    dp_group = next(iter(groups.values())).dp_process_group()
    if process_group is not None and dist.get_process_group_ranks(
        process_group
    ) != dist.get_process_group_ranks(dp_group):
        raise ValueError(
            f"GeminiDDP(process_group=ranks {dist.get_process_group_ranks(process_group)}) over "
            f"tensor-parallel ColoParameters must be their ProcessGroup's dp group (ranks "
            f"{dist.get_process_group_ranks(dp_group)}); omit process_group."
        )
    return dp_group


def tp_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state of a ``GeminiDDP`` over tensor-parallel ColoParameters: Gemini's
    ``state_dict(only_rank_0=False)`` (gathered over dp: the tp pieces), each piece gathered over
    its tp group to the full tensor — the layout of the unsharded (Hugging Face) model, on every
    rank. COLLECTIVE over the whole world.

    Raises:
        TypeError: ``model`` has no ``module`` (is not a GeminiDDP).
    """
    inner = getattr(model, "module", None)
    if not isinstance(inner, nn.Module):
        raise TypeError(f"tp_full_state_dict needs a GeminiDDP model, got {type(model).__name__}.")
    gemini: Any = model  # a GeminiDDP (importing it here would be a cycle)
    state: dict[str, torch.Tensor] = gemini.state_dict(only_rank_0=False)
    out = {}
    for name, value in state.items():
        owner, _, attr = name.rpartition(".")
        layouts = inner.get_submodule(owner).__dict__.get("_gemini_dtensor_layouts", {})
        if attr in layouts:
            layout: _Layout = layouts[attr]
            value = DTensor.from_local(
                value.to(torch.get_default_dtype()), layout.mesh, layout.placements,
                run_check=False, shape=layout.shape, stride=layout.stride,
            ).full_tensor()  # fmt: skip
        out[name] = value
    return out
