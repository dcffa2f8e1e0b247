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

import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Shard

from kolossos.tensor import ColoTensor, ColoTensorSpec, ProcessGroup
from kolossos.zero.gemini.chunk import ChunkManager
from kolossos.zero.gemini.full_tensors import local_range
from kolossos.zero.low_level.clip import power_sum

__all__ = [
    "find_tp_process_group",
    "has_tp_params",
    "prepare_dtensor_params",
    "repoint_optimizer_params",
    "tp_full_shapes",
    "tp_full_state_dict",
    "tp_full_tensors",
    "tp_grad_norm",
    "tp_group_of",
]


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


def find_tp_process_group(module: nn.Module) -> ProcessGroup | None:
    """The ``ProcessGroup`` of ``module``'s tensor-parallel ColoParameters (a mesh of more than
    one rank), before :func:`prepare_dtensor_params`; ``None`` when there are none. Not
    collective."""
    for name, param in module.named_parameters():
        if isinstance(param, DTensor) and param.device_mesh.size() > 1:
            return _process_group_of(param, name)
    return None


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
    originals: dict[int, DTensor] = {}
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
                originals[id(param)] = param
                local = param.to_local().detach()
                plain[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            sub._parameters[name] = plain[id(param)]
        if layouts:
            _read_as_dtensor(sub, layouts)
    if plain:  # for optimizers built over the ColoParameters before wrapping
        module.__dict__["_gemini_pieces"] = {
            key: (weakref.ref(old), plain[key]) for key, old in originals.items()
        }
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
        layout = _layout_of(inner, name)
        out[name] = value if layout is None else _full(value, layout)
    return out


def repoint_optimizer_params(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Replace, in ``optimizer``'s param groups, the ColoParameters that
    :func:`prepare_dtensor_params` swapped out of ``module`` by their plain pieces (an optimizer
    built over the model before ``GeminiDDP``/``booster.boost`` wrapped it). In place."""
    pieces: dict[int, tuple[weakref.ref[DTensor], nn.Parameter]] = module.__dict__.get(
        "_gemini_pieces", {}
    )
    if not pieces:
        return
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            entry = pieces.get(id(p))
            params.append(entry[1] if entry is not None and entry[0]() is p else p)
        group["params"] = params


def _layouts(module: nn.Module) -> Iterator[tuple[nn.Module, str, _Layout]]:
    for sub in module.modules():
        for name, layout in sub.__dict__.get("_gemini_dtensor_layouts", {}).items():
            yield sub, name, layout


def has_tp_params(module: nn.Module) -> bool:
    """Whether :func:`prepare_dtensor_params` turned tensor-parallel ColoParameters of
    ``module`` (Gemini's inner module) into pieces."""
    return next(_layouts(module), None) is not None


def _full(value: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The full tensor of this rank's piece ``value`` (COLLECTIVE over the tp group)."""
    return DTensor.from_local(
        value.to(torch.get_default_dtype()), layout.mesh, layout.placements,
        run_check=False, shape=layout.shape, stride=layout.stride,
    ).full_tensor()  # fmt: skip


def _layout_of(module: nn.Module, name: str) -> _Layout | None:
    owner, _, attr = name.rpartition(".")
    try:
        sub = module.get_submodule(owner)
    except AttributeError:
        return None
    layout: _Layout | None = sub.__dict__.get("_gemini_dtensor_layouts", {}).get(attr)
    return layout


def tp_full_tensors(
    module: nn.Module, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` (Gemini's full tensors over dp: the tp pieces) with each piece of a
    tensor-parallel parameter gathered over its tp group to the full tensor, the layout of the
    unsharded (Hugging Face) model. COLLECTIVE: every rank must iterate it to the end."""
    for name, value in items:
        layout = _layout_of(module, name)
        yield name, (value if layout is None else _full(value, layout))


def tp_full_shapes(
    module: nn.Module, shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """``shapes`` (Gemini's, of the pieces) with the full shape of each tensor-parallel one."""
    out = dict(shapes)
    for name in shapes:
        layout = _layout_of(module, name)
        if layout is not None:
            out[name] = tuple(layout.shape)
    return out


def _power_sum(pieces: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in pieces:
        if g.numel() == 0:
            continue
        if math.isinf(norm_type):
            total = torch.maximum(total, g.abs().max().float().to(device))
        else:
            total = total + power_sum(g, norm_type).to(device)
    return total


def tp_group_of(module: nn.Module) -> dist.ProcessGroup | None:
    """The tensor-parallel group of a Gemini model over TP pieces (``None`` without them): the
    ranks that must agree, beside the dp group, on what every rank does at a step. Not
    collective."""
    for _, _, layout in _layouts(module):
        return layout.spec.pg.tp_process_group()
    return None


def tp_grad_norm(
    module: nn.Module, manager: ChunkManager, norm_type: float, device: torch.device
) -> torch.Tensor | None:
    """The global gradient ``norm_type``-norm of a Gemini model over tensor-parallel pieces, or
    ``None`` when ``module`` has none (then Gemini's own norm over the dp group is right).

    Each rank's gradient shards are split per parameter: the pieces of parameters sharded over
    tp (a ``Shard`` placement) are summed over the tp group (every piece counts once), those of
    tp-replicated parameters (identical on the tp ranks) are not; both are then summed over the
    dp group (the chunk shards). COLLECTIVE over the tp and dp groups.
    """
    pg: ProcessGroup | None = None
    sharded: set[int] = set()
    for sub, name, layout in _layouts(module):
        pg = layout.spec.pg
        if any(isinstance(p, Shard) for p in layout.placements):
            sharded.add(id(sub._parameters[name]))
    if pg is None:
        return None
    split: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for param in module.parameters():
        if not manager.manages(param):
            continue
        chunk, info = manager.locate(param)
        span = local_range(chunk, info)
        if chunk.grad_shard is None or span is None:
            continue
        split[id(param) in sharded].append(chunk.grad_shard[span[0] : span[1]])
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    tp_part = _power_sum(split[True], norm_type, device)
    dist.all_reduce(tp_part, op=op, group=pg.tp_process_group())
    rest = _power_sum(split[False], norm_type, device)
    total = torch.maximum(tp_part, rest) if inf else tp_part + rest
    dist.all_reduce(total, op=op, group=pg.dp_process_group())
    return total if inf else total ** (1.0 / norm_type)
