"""Pipeline stages of a Hugging Face model, cut along its plan's :class:`StageLayout`.

A *stage chunk* is the model's own top-level module (its class, config, ``forward``) keeping only
the modules one virtual pipeline stage owns:

* the repeated blocks ``[start, end)`` of :attr:`StageLayout.blocks` (under their original
  indices, so ``state_dict`` names equal the whole model's);
* the embeddings when the chunk is the first stage, the final modules (norm, head) when it is the
  last; elsewhere those holding parameters (and dropouts) are *hollow*: parameter-free stand-ins
  that keep the attributes the model's ``forward`` reads (dtype, device) and return zeros shaped
  like the received activation.

The model's own ``forward`` runs on every stage, so masks, position ids and rotary tables are
built exactly as in one process. A later stage injects the received hidden state at the input of
its first block (a pre-hook); a stage that is not the last leaves the model right after its last
block (a hook raising an internal exception carrying the block output). Between stages a chunk
sends ``(hidden_state, presence, *input tensors)``: the model inputs travel with the activation
(``presence`` says which of the forward's arguments they are), because every stage's forward
needs them (masks) and the last one needs the labels.

Only the objects on the path from the root to the layout's modules are copied (shallowly), so the
chunks share parameters with the sharded model and cost no memory.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from kolossos.shardformer.policies.base_policy import StageLayout
from kolossos.shardformer.shardformer import _resolve_plan

__all__ = ["StageRange", "build_stage_chunk", "check_layout_covers", "layout_of"]


@dataclass(frozen=True, kw_only=True)
class StageRange:
    """The blocks one virtual stage owns, and whether it is the first / last stage."""

    start: int
    """First block index (inclusive)."""
    end: int
    """Last block index (exclusive)."""
    first: bool
    """This stage runs the embeddings."""
    last: bool
    """This stage runs the final modules and returns the model's output."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"stage blocks [{self.start}, {self.end}) must be a non-empty range.")


def layout_of(model: nn.Module, policy: Any = None) -> StageLayout:
    """The stage layout of ``model``'s plan (``policy``: a Policy, a ModelPlan or ``None`` for
    the family's automatic plan).

    Raises:
        ValueError / NotImplementedError: no plan for the model (the plan lookup's message).
    """
    return _resolve_plan(model, policy).layout


def _owned_prefixes(layout: StageLayout) -> tuple[str, ...]:
    return (layout.blocks, *layout.embeddings, *layout.final)


def check_layout_covers(model: nn.Module, layout: StageLayout) -> None:
    """Every parameter must live under a module of the layout (else it would be replicated on
    all stages without its gradients being summed).

    Raises:
        NotImplementedError: a parameter outside the embeddings, blocks and final modules.
    """
    prefixes = _owned_prefixes(layout)
    for name, _ in model.named_parameters(remove_duplicate=False):
        if not any(name == p or name.startswith(p + ".") for p in prefixes):
            raise NotImplementedError(
                f"parameter {name!r} lies outside the plan's stage layout (embeddings "
                f"{layout.embeddings}, blocks {layout.blocks!r}, final {layout.final}); pipeline "
                "parallelism cannot place it: pass a custom_policy whose StageLayout covers it."
            )


class _StageBlocks(nn.ModuleList):
    """The blocks a stage owns, registered under their indices in the whole model (so names
    are global); iterating or slicing sees only them, in order."""

    def __init__(self, blocks: Iterable[tuple[int, nn.Module]] = ()) -> None:
        super().__init__()
        for index, block in blocks:
            self.add_module(str(index), block)

    def __getitem__(self, idx: Any) -> Any:
        owned = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(owned[idx])
        return owned[idx]


class _StageExit(Exception):
    """Leaves the model's forward after the stage's last block."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage exit")
        self.output = output


def _hollow(module: nn.Module, runner: _StageRunner) -> nn.Module:
    """A parameter-free stand-in of ``module`` (same class and attributes; its parameters and
    buffers are empty tensors of the same dtype and device) whose call returns zeros shaped like
    the activation the stage received."""
    new = copy.copy(module)
    new._parameters = {}
    new._buffers = {}
    new._non_persistent_buffers_set = set()
    new._modules = {
        name: _hollow(child, runner) for name, child in module._modules.items() if child
    }
    for attr, value in module.__dict__.items():  # the original's hooks must not run here
        if attr.endswith("hooks") and isinstance(value, dict):
            setattr(new, attr, type(value)())
    for name, tensor in (*module._parameters.items(), *module._buffers.items()):
        if tensor is not None:
            object.__setattr__(new, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
    object.__setattr__(new, "forward", runner.zeros)
    return new


def _copy_spine(root: nn.Module, paths: Iterable[str]) -> tuple[nn.Module, dict[str, nn.Module]]:
    """Shallow copies of ``root`` and every module on the way to ``paths`` (their child dicts
    copied too), so children can be swapped without touching the original model. Returns the
    new root and ``{ancestor path: its copy}``."""
    new_root = copy.copy(root)
    new_root._modules = dict(root._modules)
    copies: dict[str, nn.Module] = {"": new_root}
    for path in paths:
        parts = path.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            if prefix not in copies:
                parent = copies[".".join(parts[: depth - 1])]
                node = copy.copy(parent._modules[parts[depth - 1]])
                assert node is not None
                node._modules = dict(node._modules)
                parent._modules[parts[depth - 1]] = node
                copies[prefix] = node
    return new_root, copies


def _replace(copies: dict[str, nn.Module], path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    copies[parent]._modules[name] = module


class _StageRunner:
    """The forward of one stage chunk (see the module docstring)."""

    def __init__(self, chunk: nn.Module, stage: StageRange, forward: Callable[..., Any]) -> None:
        self.stage = stage
        self.forward = forward
        params = inspect.signature(forward).parameters.values()
        self.names = [
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)
        ]
        self.takes_use_cache = "use_cache" in self.names
        self.injected: torch.Tensor | None = None
        self.active = False
        """inside this chunk's forward (the hooks sit on blocks the whole model shares)"""
        self.chunk_type = type(chunk).__name__

    # --- hooks ---------------------------------------------------------------------------------
    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Output of a hollow module: zeros like the received activation."""
        if self.injected is None:
            raise RuntimeError(
                f"a hollow module of pipeline stage {self.chunk_type} was called outside the "
                "stage's forward; run the model through booster.execute_pipeline."
            )
        return torch.zeros_like(self.injected)

    def inject(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Pre-hook of the first block: its hidden-state input is the received activation."""
        if not self.active:
            return None
        if args:
            return (self.injected, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.injected}

    def leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Hook of the last block of a non-last stage: stop the model here."""
        if not self.active:
            return
        raise _StageExit(output[0] if isinstance(output, (tuple, list)) else output)

    # --- inputs --------------------------------------------------------------------------------
    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        bound = dict(zip(self.names, args, strict=False))
        bound.update(kwargs)
        out = {}
        for name, value in bound.items():
            if name not in self.names:
                raise TypeError(f"{self.chunk_type}.forward has no argument {name!r}.")
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"pipeline micro-batches carry tensors only, got {name}={value!r}; drop it "
                    "from the batch or set it in the model's config."
                )
            out[name] = value
        return out

    def _encode(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        present = [name for name in self.names if name in inputs]
        device = next(iter(inputs.values())).device if inputs else torch.device("cpu")
        mask = torch.tensor([int(n in inputs) for n in self.names], dtype=torch.int64)
        return [mask.to(device), *(inputs[name] for name in present)]

    def _decode(self, mask: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        present = [name for name, flag in zip(self.names, mask.tolist(), strict=True) if flag]
        return dict(zip(present, tensors, strict=True))

    # --- forward -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage.first:
            inputs = self._bind(args, kwargs)
            carried = self._encode(inputs)
        else:
            hidden, *carried = args
            inputs = self._decode(carried[0], tuple(carried[1:]))
            self.injected = hidden
        call: dict[str, Any] = dict(inputs)
        if self.takes_use_cache:
            call["use_cache"] = False
        self.active = True
        try:
            output = self.forward(**call)
        except _StageExit as stop:
            return (stop.output, *carried)
        finally:
            self.injected, self.active = None, False
        if not self.stage.last:
            raise RuntimeError(
                f"{self.chunk_type}: the stage's last block did not run; check the plan's "
                "StageLayout.blocks."
            )
        return output


def build_stage_chunk(model: nn.Module, layout: StageLayout, stage: StageRange) -> nn.Module:
    """The chunk of ``model`` for one virtual stage (see the module docstring).

    The returned module shares its parameters with ``model``; its ``state_dict`` / parameter
    names are the whole model's names of the modules it owns.

    Args:
        model: the (possibly tensor-parallel) model.
        layout: its plan's stage layout.
        stage: the blocks this stage owns and whether it is first / last.

    Raises:
        ValueError: a block range outside the model.

    Example:
        >>> chunk = build_stage_chunk(gpt2, layout, StageRange(start=0, end=2, first=True,
        ...                                                    last=False))  # doctest: +SKIP
        >>> hidden, *carried = chunk(input_ids=ids)  # doctest: +SKIP
    """
    blocks = model.get_submodule(layout.blocks)
    assert isinstance(blocks, nn.ModuleList), layout.blocks
    if stage.end > len(blocks):
        raise ValueError(
            f"stage blocks [{stage.start}, {stage.end}) exceed the {len(blocks)} blocks at "
            f"{layout.blocks!r}."
        )
    chunk, copies = _copy_spine(model, _owned_prefixes(layout))
    runner = _StageRunner(chunk, stage, type(model).forward.__get__(chunk))
    owned = [(i, blocks[i]) for i in range(stage.start, stage.end)]
    _replace(copies, layout.blocks, _StageBlocks(owned))
    hollow_paths = (() if stage.first else layout.embeddings) + (() if stage.last else layout.final)
    for path in hollow_paths:
        module = model.get_submodule(path)
        # parameter-free modules (rotary tables) still run; dropout of zeros is skipped
        if any(True for _ in module.parameters()) or isinstance(module, nn.Dropout):
            _replace(copies, path, _hollow(module, runner))
    handles = []
    if not stage.first:
        handles.append(owned[0][1].register_forward_pre_hook(runner.inject, with_kwargs=True))
    if not stage.last:
        handles.append(owned[-1][1].register_forward_hook(runner.leave))
    object.__setattr__(chunk, "forward", runner)
    object.__setattr__(chunk, "_kolossos_stage", stage)
    object.__setattr__(chunk, "_kolossos_stage_hooks", handles)
    return chunk


def stage_of(chunk: nn.Module) -> StageRange | None:
    """The :class:`StageRange` of a chunk built by :func:`build_stage_chunk` (else ``None``)."""
    return getattr(chunk, "_kolossos_stage", None)
