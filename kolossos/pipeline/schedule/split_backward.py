"""The backward of one stage split in two: input gradients now (``B``, on the critical path),
weight gradients later (``W``), for the zero-bubble schedules.

How: walk the autograd graph of the stage's outputs once. A node *reaches the input* when the
stage input's gradient depends on it. Every path from an output to a parameter leaves the
input-reaching part of the graph exactly once, at a *boundary node* (it reaches the input, its
child on the path does not). ``B`` runs ``torch.autograd.grad`` for the inputs only, which
executes exactly the input-reaching nodes and skips the weight-only branches, while hooks record
the gradient arriving at each boundary node. ``W`` restarts autograd from those boundary nodes
(``GradientEdge``) toward the parameters, so the input-side work is not repeated and the weight
gradients accumulate into ``.grad`` as in a plain backward (gradient hooks fire).

If one restart could walk back into the input-reaching part and reach its own parameters again
(a weight used at two depths of the same stage), splitting would count some paths twice; such a
micro-batch runs the plain backward during ``B`` and its ``W`` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradWork", "backward_input", "backward_weight"]


@dataclass
class WeightGradWork:
    """What ``B`` leaves for ``W``: per parameter group, the restart points, their gradients
    and the parameters they lead to."""

    groups: list[tuple[list[GradientEdge | torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]
    split: bool = True
    """``False``: ``B`` already ran the full backward"""
    hooks: list[object] = field(default_factory=list)


def _analyse(
    roots: list[Node], inputs: set[Node], params: dict[Node, int]
) -> dict[Node, tuple[bool, int]]:
    """For every node reachable from ``roots``: whether it reaches an input node, and the bits
    of the parameters it reaches. One post-order walk (children before parents)."""
    info: dict[Node, tuple[bool, int]] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            reach, mask = node in inputs, params.get(node, 0)
            for child, _ in node.next_functions:
                if child is not None:
                    c_reach, c_mask = info[child]
                    reach, mask = reach or c_reach, mask | c_mask
            info[node] = (reach, mask)
        elif node not in info:
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions if c is not None)
    return info


def _plan(
    roots: list[Node], inputs: list[Node], params: list[Node]
) -> tuple[dict[Node, tuple[int, int]], list[tuple[int, int]]]:
    """Boundary nodes with ``(bits, inside)``: the parameters reached through their weight-only
    children, and those reached through their input-reaching children; and the indices of the
    roots that start in the weight-only part, with their parameter bits."""
    bit_of: dict[Node, int] = {}
    for i, node in enumerate(params):  # bit i <-> params[i]
        bit_of[node] = bit_of.get(node, 0) | (1 << i)
    info = _analyse(roots, set(inputs), bit_of)
    boundary: dict[Node, tuple[int, int]] = {}
    for node, (reach, _) in info.items():
        if not reach:
            continue
        bits = inside = 0
        for child, _ in node.next_functions:
            if child is None:
                continue
            c_reach, c_mask = info[child]
            if c_reach:
                inside |= c_mask
            else:
                bits |= c_mask
        if bits:
            boundary[node] = (bits, inside)
    weight_roots = [(i, info[r][1]) for i, r in enumerate(roots) if not info[r][0] and info[r][1]]
    return boundary, weight_roots


def _groups(boundary: dict[Node, tuple[int, int]]) -> list[tuple[list[Node], int]] | None:
    """Boundary nodes merged into restarts that can share one autograd call: a call toward a
    set of parameters must not reach any of them through an input-reaching child (it would count
    that path a second time). ``None`` when even a single node violates it."""
    groups: list[tuple[list[Node], int, int]] = []
    for node, (bits, inside) in boundary.items():
        if inside & bits:
            return None
        for k, (nodes, g_bits, g_inside) in enumerate(groups):
            if not ((g_inside | inside) & (g_bits | bits)):
                groups[k] = ([*nodes, node], g_bits | bits, g_inside | inside)
                break
        else:
            groups.append(([node], bits, inside))
    return [(nodes, bits) for nodes, bits, _ in groups]


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradWork]:
    """The ``B`` part: gradients of ``inputs`` (``None`` where an input needs none), and the work
    left for :func:`backward_weight`.

    Args:
        outputs: the stage's outputs (the scaled loss on the last stage).
        grads: their upstream gradients (``None`` for a scalar loss).
        inputs: the stage's input tensors (received activations).
        params: the stage's parameters that need gradients.
    """
    live = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.grad_fn is not None]
    need = [t for t in inputs if t.requires_grad]
    params = list(params)
    if not live:
        return [None] * len(inputs), WeightGradWork([])
    if not need:  # the first stage: no input gradient, the whole backward is weight work
        outs: list[GradientEdge | torch.Tensor] = [o for o, _ in live]
        seeds = [g if g is not None else torch.ones_like(o) for o, g in live]
        return [None] * len(inputs), WeightGradWork([(outs, seeds, params)])
    roots: list[Node] = [o.grad_fn for o, _ in live]  # type: ignore[misc]
    in_nodes = [get_gradient_edge(t).node for t in need]
    p_nodes = [get_gradient_edge(p).node for p in params]
    boundary, weight_roots = _plan(roots, in_nodes, p_nodes)
    groups = _groups(boundary)
    if groups is None:
        return _plain(live, need, inputs, params), WeightGradWork([], split=False)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [
        node.register_prehook(lambda g, node=node: captured.__setitem__(node, tuple(g)))
        for node in boundary
    ]
    try:
        got = torch.autograd.grad([o for o, _ in live], need, [g for _, g in live],
                                  retain_graph=True, allow_unused=True)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    by_input = dict(zip(map(id, need), got, strict=True))
    work = WeightGradWork([])
    for nodes, bits in groups:
        starts: list[GradientEdge | torch.Tensor] = []
        values: list[torch.Tensor] = []
        for node in nodes:
            for k, g in enumerate(captured.get(node, ())):
                if g is not None:
                    starts.append(GradientEdge(node, k))
                    values.append(g)
        if starts:
            work.groups.append((starts, values, _select(params, bits)))
    for i, bits in weight_roots:
        out, g = live[i]
        work.groups.append(([out], [g if g is not None else torch.ones_like(out)],
                            _select(params, bits)))  # fmt: skip
    return [by_input.get(id(t)) for t in inputs], work


def _plain(
    live: list[tuple[torch.Tensor, torch.Tensor | None]],
    need: list[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: list[torch.Tensor],
) -> list[torch.Tensor | None]:
    """The whole backward at once; returns the input gradients (inputs' ``.grad`` untouched)."""
    before = [t.grad for t in need]
    for t in need:
        t.grad = None
    torch.autograd.backward([o for o, _ in live], [g for _, g in live], inputs=[*need, *params])
    got = {id(t): t.grad for t in need}
    for t, old in zip(need, before, strict=True):
        t.grad = old
    return [got.get(id(t)) for t in inputs]


def _select(params: list[torch.Tensor], bits: int) -> list[torch.Tensor]:
    return [p for i, p in enumerate(params) if bits >> i & 1]


def backward_weight(work: WeightGradWork) -> None:
    """The ``W`` part: accumulate the parameters' gradients into ``.grad``."""
    for starts, seeds, params in work.groups:
        if params:
            torch.autograd.backward(starts, seeds, inputs=params)  # type: ignore[arg-type]
    work.groups.clear()
