"""``PipelinableContext`` (Colossal-AI's ``colossalai.pipeline.pipelinable``): build a whole model
inside ``with pipelinable:``, name its execution order with :meth:`~PipelinableContext.
to_layer_list`, and keep one pipeline rank's layers with :meth:`~PipelinableContext.partition`.

The context records every ``nn.Module`` constructed inside it; the *model* is the outermost one
built last (e.g. the ``ResNet`` of ``resnet50()``). ``exec_seq`` lists, in data-flow order:

* submodule names (as in ``model.named_modules()``, dotted for nested ones): one *layer* each;
* ``(callable, "behind")``: run after the layer named before it (e.g. ``torch.flatten``); a bare
  callable means the same;
* ``(callable, "front")``: run before the layer named after it;
* ``"SPLIT_NODE"``: a stage boundary, used by the ``"customized"`` policy.

Each layer keeps its functions, so they move with it to its stage. The layers are the very
modules the model was built with (no re-initialisation), so a pipelined model starts from the
same weights as the unsplit one. It takes no process group: the pipeline size and rank are
arguments (``gpc.pipeline_parallel_size``, ``gpc.get_local_rank(ParallelMode.PIPELINE)`` with the
legacy API).

Example:
    >>> ctx = PipelinableContext(policy="uniform")
    >>> with ctx:
    ...     model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> ctx.to_layer_list(["0", "1", (lambda x: x * 2, "behind"), "2"])
    >>> stage = ctx.partition(1, 2, 0)  # pipeline rank 0 of 2
    >>> stage.layer_names
    ['0']
"""

from __future__ import annotations

import difflib
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn

from kolossos.logging import get_dist_logger
from kolossos.pipeline.partition import (
    Bounds,
    partition_balanced,
    partition_uniform,
    per_rank,
)

__all__ = ["SPLIT_NODE", "PipelinableContext", "PipelinableModel"]

SPLIT_NODE = "SPLIT_NODE"
POLICIES = ("balanced", "uniform", "customized")
Policy = str | Mapping[int, Sequence[tuple[int, int]]]


@dataclass
class _Layer:
    """One entry of the layer list: a submodule and the functions around it."""

    name: str
    module: nn.Module
    front: list[Callable[..., Any]] = field(default_factory=list)
    behind: list[Callable[..., Any]] = field(default_factory=list)


def _check_policy(policy: Any) -> Policy:
    if isinstance(policy, str) and policy in POLICIES:
        return policy
    if isinstance(policy, Mapping):
        return policy
    raise ValueError(
        f"policy={policy!r} is unknown; use one of {POLICIES} or a dict mapping each pipeline "
        "rank to its list of (start, end) layer ranges."
    )


class PipelinableContext:
    """Records the modules built inside ``with`` and splits the model into pipeline stages.

    Args:
        policy: how :meth:`partition` splits the layer list: ``"balanced"`` (by parameter
            count, the default as upstream), ``"uniform"`` (by layer count), ``"customized"``
            (at the ``"SPLIT_NODE"`` entries of ``exec_seq``), or a dict ``{rank: [(start,
            end), ...]}``.

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, policy: Policy = "balanced") -> None:
        self._policy = _check_policy(policy)
        self._created: list[nn.Module] = []
        self._model: nn.Module | None = None
        self._layers: list[_Layer] = []
        self._splits: list[int] = []
        self._original_init: Callable[..., None] | None = None

    # --- recording ----------------------------------------------------------------------------
    def __enter__(self) -> PipelinableContext:
        if self._original_init is not None:
            raise RuntimeError("this PipelinableContext is active already; do not nest it.")
        original = nn.Module.__init__
        created = self._created

        def recording_init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            created.append(module)

        self._original_init = original
        nn.Module.__init__ = recording_init  # type: ignore[method-assign,assignment]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._original_init is not None
        nn.Module.__init__ = self._original_init  # type: ignore[method-assign]
        self._original_init = None
        inner = {id(m) for top in self._created for m in top.modules() if m is not top}
        roots = [m for m in self._created if id(m) not in inner]
        self._model = roots[-1] if roots else None
        self._created = []

    @property
    def model(self) -> nn.Module:
        """The outermost module built last inside the context.

        Raises:
            RuntimeError: no module was built inside ``with pipelinable:``.
        """
        if self._model is None:
            raise RuntimeError(
                "no model was built inside `with pipelinable:`; build the whole model there, "
                "e.g. `with pipelinable: model = resnet50()`."
            )
        return self._model

    @property
    def policy(self) -> Policy:
        """The partition policy (settable)."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._policy = _check_policy(policy)

    @property
    def layers_count(self) -> int:
        """Number of layers in the layer list."""
        return len(self._layers)

    @property
    def funcs_count(self) -> int:
        """Number of layers with functions attached (before or after them)."""
        return sum(1 for layer in self._layers if layer.front or layer.behind)

    @property
    def layer_names(self) -> list[str]:
        """The layer list's module names, in execution order."""
        return [layer.name for layer in self._layers]

    # --- the layer list -----------------------------------------------------------------------
    def to_layer_list(self, exec_seq: Sequence[Any] | None = None) -> None:
        """Make the layer list from ``exec_seq`` (see the module docstring); ``None``: the
        model's children in construction order, the members of a child ``nn.Sequential`` /
        ``nn.ModuleList`` one by one.

        Raises:
            RuntimeError: no model was built inside the context.
            ValueError: a name that is no submodule of the model, a function placed before
                any layer (``"behind"``) or after the last one (``"front"``), or no layer at all.
            TypeError: an entry that is not a name, a callable or a ``(callable, position)``.
        """
        model = self.model
        if exec_seq is None:
            exec_seq = _default_sequence(model)
        modules = dict(model.named_modules())
        layers: list[_Layer] = []
        splits: list[int] = []
        front: list[Callable[..., Any]] = []
        for index, entry in enumerate(exec_seq):
            if entry == SPLIT_NODE:
                splits.append(len(layers))
            elif isinstance(entry, str):
                if entry not in modules or entry == "":
                    raise ValueError(_missing(entry, index, modules))
                layers.append(_Layer(entry, modules[entry], front))
                front = []
            else:
                func, where = _function_entry(entry, index)
                if where == "front":
                    front.append(func)
                elif not layers:
                    raise ValueError(
                        f"exec_seq[{index}] runs a function 'behind' but no module comes before "
                        "it; name a module first or mark the function (func, 'front')."
                    )
                else:
                    layers[-1].behind.append(func)
        if front:
            raise ValueError(
                "exec_seq ends with (func, 'front') entries but no module follows them; mark "
                "them 'behind' or name the module they precede."
            )
        if not layers:
            raise ValueError("exec_seq names no module: list the model's layers in order.")
        self._layers, self._splits = layers, splits
        _warn_unlisted(model, layers)

    # --- partitioning -------------------------------------------------------------------------
    def partition(self, num_chunks: int, pipeline_size: int, rank: int) -> nn.Module:
        """This pipeline rank's layers.

        Args:
            num_chunks: model chunks per rank (interleaved schedules; 1 otherwise).
            pipeline_size: the number of pipeline ranks.
            rank: this process's pipeline rank.

        Returns:
            A :class:`PipelinableModel` with one chunk, else an ``nn.ModuleList`` of one per
            chunk (chunk ``c`` of rank ``r`` is virtual stage ``c * pipeline_size + r``).

        Raises:
            RuntimeError: :meth:`to_layer_list` was not called.
            ValueError: a size or rank out of range, fewer layers than stages, or a customized
                split that does not give one part per stage.
        """
        for name, value in (("num_chunks", num_chunks), ("pipeline_size", pipeline_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if not 0 <= rank < pipeline_size:
            raise ValueError(f"rank={rank} must be in [0, {pipeline_size}) (the pipeline size).")
        if not self._layers:
            raise RuntimeError(
                "call pipelinable.to_layer_list(exec_seq) before partition(): the layer list "
                "is empty."
            )
        parts = self._parts(num_chunks, pipeline_size)[rank]
        chunks = [PipelinableModel(self._layers[start:end]) for start, end in parts]
        return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)

    def _parts(self, num_chunks: int, pipeline_size: int) -> list[Bounds]:
        n = len(self._layers)
        policy = self._policy
        if isinstance(policy, Mapping):
            return [list(policy[r]) for r in range(pipeline_size)]
        if policy == "uniform":
            return partition_uniform(n, pipeline_size, num_chunks)
        if policy == "balanced":
            weights = [sum(p.numel() for p in layer.module.parameters()) for layer in self._layers]
            return partition_balanced(weights, pipeline_size, num_chunks)
        cuts = sorted({0, *self._splits, n})
        bounds = list(itertools.pairwise(cuts))
        if len(bounds) != pipeline_size * num_chunks:
            raise ValueError(
                f"the customized policy cuts exec_seq at its 'SPLIT_NODE' entries into "
                f"{len(bounds)} parts, but {pipeline_size} ranks x {num_chunks} chunks need "
                f"{pipeline_size * num_chunks}; add or remove SPLIT_NODE entries."
            )
        return per_rank(bounds, pipeline_size, num_chunks, "loop")


def _default_sequence(model: nn.Module) -> list[str]:
    names: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            names += [f"{name}.{sub}" for sub, _ in child.named_children()]
        else:
            names.append(name)
    return names


def _missing(name: str, index: int, modules: Mapping[str, nn.Module]) -> str:
    close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    top = ", ".join(n for n in modules if n and "." not in n)
    return (
        f"exec_seq[{index}] names module {name!r}, which the model does not have{hint}; use "
        f"names from model.named_modules() (top level: {top})."
    )


def _function_entry(entry: Any, index: int) -> tuple[Callable[..., Any], str]:
    if callable(entry) and not isinstance(entry, nn.Module):
        return entry, "behind"
    if isinstance(entry, tuple) and len(entry) == 2 and callable(entry[0]):
        if entry[1] in ("front", "behind"):
            return entry[0], entry[1]
        raise ValueError(
            f"exec_seq[{index}] places a function {entry[1]!r}; use 'front' or 'behind'."
        )
    raise TypeError(
        f"exec_seq[{index}]={entry!r} is neither a module name, a callable, nor a (callable, "
        "'front' | 'behind') pair."
    )


def _warn_unlisted(model: nn.Module, layers: list[_Layer]) -> None:
    listed = {id(p) for layer in layers for p in layer.module.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in listed]
    if missing:
        get_dist_logger().warning(
            f"exec_seq leaves out modules holding parameters {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: no pipeline stage will hold or train them."
        )


def _accepted(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``func`` takes by name (all of them with ``**kwargs``)."""
    if not kwargs:
        return {}
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature take none
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _call(func: Callable[..., Any], value: Any, kwargs: Mapping[str, Any]) -> Any:
    extra = _accepted(func.forward if isinstance(func, nn.Module) else func, kwargs)
    if value is None:
        return func(**extra)
    if isinstance(value, (tuple, list)):
        return func(*value, **extra)
    return func(value, **extra)


class PipelinableModel(nn.Module):
    """One chunk of a pipelined model: its layers run in order, each followed by its functions.

    The first layer takes the chunk's positional inputs; every layer and function also gets the
    keyword inputs its signature names (a dict batch's entries, e.g. ``attention_mask``).

    Args:
        layers: the chunk's layers (from :meth:`PipelinableContext.partition`).
    """

    def __init__(self, layers: Sequence[_Layer]) -> None:
        super().__init__()
        self._module_list = nn.ModuleList([layer.module for layer in layers])
        self.layer_names = [layer.name for layer in layers]
        self._front = [list(layer.front) for layer in layers]
        self._behind = [list(layer.behind) for layer in layers]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the layers on ``inputs`` (one tensor, several, or none with keyword inputs)."""
        value: Any = inputs[0] if len(inputs) == 1 else (inputs or None)
        for module, front, behind in zip(self._module_list, self._front, self._behind,
                                         strict=True):  # fmt: skip
            for func in front:
                value = _call(func, value, kwargs)
            value = _call(module, value, kwargs)
            for func in behind:
                value = _call(func, value, kwargs)
        return value

    def named_layer_parameters(self) -> dict[str, torch.Tensor]:
        """The chunk's parameters under the whole model's names (``<layer name>.<parameter>``)."""
        return {
            f"{name}.{pname}": p
            for name, module in zip(self.layer_names, self._module_list, strict=True)
            for pname, p in module.named_parameters()
        }
