"""Linearise a traced model into a chain of runnable stages, one per block.

The model is traced with :class:`~kolossos.auto_parallel.ColoTracer` (``torch.fx``); each node is
given to the block (the module path cut to ``depth`` components: ``blocks.0.conv1`` is in block
``blocks.0`` at depth 2) whose module it calls, functions and methods to the block that ran last.
``torch.fx.passes.split_module`` turns the groups into graph modules that share the model's
parameters. The result is a chain only if every stage takes exactly the previous stage's output:
a skip connection across stages, or a second model input, is reported with the stage and node.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from kolossos.auto_parallel.traced_graph import TracingError
from kolossos.auto_parallel.tracer import ColoTracer

__all__ = ["linearize"]


def _block_of(node: fx.Node, depth: int) -> str | None:
    if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
        return ".".join(node.target.split(".")[:depth])
    return None


def _partition(gm: fx.GraphModule, depth: int) -> tuple[dict[fx.Node, int], list[str]]:
    parts: dict[fx.Node, int] = {}
    names: list[str] = []
    current = -1
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        block = _block_of(node, depth)
        if block is not None and (not names or names[-1] != block):
            if block in names:
                raise TracingError(
                    f"block {block!r} runs again at node {node.name!r} after "
                    f"{names[-1]!r}: the model is not a chain of blocks at depth={depth}."
                )
            names.append(block)
        current = max(len(names) - 1, 0)
        if not names:
            names.append(node.name)
        parts[node] = current
    return parts, names


def linearize(
    model: torch.nn.Module, meta_args: Mapping[str, Any], depth: int = 1
) -> tuple[list[str], list[torch.nn.Module]]:
    """Split ``model`` into its chain of blocks at module-path ``depth``.

    Args:
        model: a module ``torch.fx`` can trace whose blocks run one after the other.
        meta_args: its single input by name (meta tensors allowed), as for ``ColoTracer.trace``.
        depth: how many components of a module path name a block.

    Returns:
        The block names and the stage modules (sharing ``model``'s parameters), in order; the
        stages applied one after the other compute ``model``'s forward.

    Raises:
        ValueError: ``depth < 1``.
        TracingError: the model does not trace, or is not a chain at that depth (the message
            names the stage and the node that breaks the chain).
    """
    if depth < 1:
        raise ValueError(f"depth={depth} must be >= 1.")
    gm = ColoTracer(backend="fx").trace(model, meta_args).graph_module
    parts, names = _partition(gm, depth)
    split = split_module(gm, model, lambda node: parts[node])
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    previous: fx.Node | None = None
    for call in calls:
        inputs = list(call.all_input_nodes)
        chained = previous is None or inputs == [previous]
        if not chained or len(inputs) != 1:
            raise TracingError(
                f"stage {call.target!r} (block {names[int(str(call.target).split('_')[-1])]!r}) "
                f"takes {[n.name for n in inputs]}, not only the previous stage's output: the "
                f"model is not a chain at depth={depth} (a skip connection across blocks or a "
                "second input); choose another depth or wrap the skip inside one block."
            )
        previous = call
    stages = [split.get_submodule(str(call.target)) for call in calls]
    return [names[int(str(c.target).split("_")[-1])] for c in calls], stages
