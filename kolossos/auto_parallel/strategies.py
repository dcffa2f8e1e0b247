"""Per-operator sharding strategies and their costs on a 1-d mesh of ``P`` ranks.

A tensor between two operators has one of three layouts (the :mod:`sharding_spec` names in
brackets, for a 2-d activation ``[batch, features]`` on mesh axis 0):

* ``"B"`` — batch-sharded, ``[S0, R]`` (data parallel);
* ``"R"`` — replicated, ``[R, R]``;
* ``"F"`` — feature-sharded, ``[R, S0]`` (between a Megatron column and row linear);

and for a transformer's ``[batch, seq, hidden]`` activations a fourth, ``"Q"`` —
sequence-sharded, ``[R, S0, R]`` (:mod:`~kolossos.auto_parallel.transformer_strategies`).

Each operator of a traced chain gets a list of :class:`Strategy` objects: an input layout, an
output layout, and its predicted cost per rank — compute time (forward + backward FLOPs at the
cost model's rate), communication time (alpha-beta), parameter memory (parameter, gradient and
two Adam states, fp32) and activation memory.

Supported operators: ``nn.Linear`` (data parallel, column, row, replicated), elementwise
activations (``ReLU``, ``GELU``, ``Tanh``, ``Sigmoid``, ``SiLU``, ``Dropout`` with ``p=0`` and their
functional forms) and ``nn.LayerNorm`` (data parallel or replicated). Anything else raises
:class:`UnsupportedOperatorError` naming the node and the operator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx, nn

__all__ = [
    "CostModel",
    "Layout",
    "OpKind",
    "Strategy",
    "UnsupportedOperatorError",
    "classify",
    "reshard_cost",
    "strategies_for",
]

Layout = Literal["B", "R", "F", "Q"]
OpKind = Literal["linear", "elementwise", "layernorm"]

# Adam in fp32: the parameter, its gradient, exp_avg and exp_avg_sq.
_STATE_COPIES = 4
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Identity)
_ELEMENTWISE_FUNCTIONS = {
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    nn.functional.relu,
    nn.functional.gelu,
    nn.functional.silu,
    torch.nn.functional.tanh,
    torch.nn.functional.sigmoid,
}


class UnsupportedOperatorError(NotImplementedError):
    """The auto-parallel strategy search has no strategies for an operator (names node and op)."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicts compute and communication time on a 1-d mesh.

    ``alpha`` (seconds per collective) and ``beta`` (seconds per byte) come from
    :class:`~kolossos.device.alpha_beta_profiler.AlphaBetaProfiler` or a measured constant;
    ``flops_per_s`` from :func:`~kolossos.auto_parallel.cost.measure_flops_rate` or a constant.
    """

    world_size: int
    """Ranks on the mesh axis."""
    flops_per_s: float = 5e9
    """Sustained matmul rate of one rank."""
    alpha: float = 1e-4
    """Latency of one collective, seconds."""
    beta: float = 1e-9
    """Inverse bandwidth, seconds per byte."""
    op_s: float = 0.0
    """Forward + backward dispatch cost of one operator (what small operators cost on a CPU);
    used by the transformer strategies, 0 keeps a pure FLOPs model."""
    optimizer_tensor_s: float = 0.0
    """Optimizer step cost per parameter tensor held (transformer strategies)."""
    optimizer_byte_s: float = 0.0
    """Optimizer step cost per parameter byte held (transformer strategies)."""
    copy_byte_s: float = 0.0
    """Cost of copying one byte (gradients into and out of the data-parallel flat buffer)."""
    op_byte_s: float = 0.0
    """Forward + backward cost per output byte of a memory-bound (non-matmul) operator, on top
    of ``op_s`` (transformer strategies; 0 keeps a dispatch-only model)."""

    def __post_init__(self) -> None:
        extra = (
            self.op_s,
            self.optimizer_tensor_s,
            self.optimizer_byte_s,
            self.copy_byte_s,
            self.op_byte_s,
        )
        if self.world_size < 1 or self.flops_per_s <= 0 or min(self.alpha, self.beta, *extra) < 0:
            raise ValueError(
                f"CostModel needs world_size >= 1, flops_per_s > 0, alpha, beta >= 0 (got {self}); "
                "pass measured values."
            )

    def compute(self, forward_flops: float) -> float:
        """Forward + backward (twice the forward) time of ``forward_flops``."""
        return 3.0 * forward_flops / self.flops_per_s

    def all_reduce(self, num_bytes: float) -> float:
        """Ring all-reduce of ``num_bytes`` (0 on one rank)."""
        p = self.world_size
        return 0.0 if p == 1 else self.alpha + self.beta * 2 * (p - 1) / p * num_bytes

    def ring_bytes(self, num_bytes: float) -> float:
        """The bandwidth part of an all-reduce of ``num_bytes`` (no latency; 0 on one rank)."""
        p = self.world_size
        return 0.0 if p == 1 else self.beta * 2 * (p - 1) / p * num_bytes

    def optimizer(self, tensors: float, num_bytes: float) -> float:
        """Optimizer step time for ``tensors`` parameter tensors of ``num_bytes`` in all."""
        return self.optimizer_tensor_s * tensors + self.optimizer_byte_s * num_bytes

    def all_gather(self, num_bytes: float) -> float:
        """All-gather producing ``num_bytes`` in total (0 on one rank)."""
        p = self.world_size
        return 0.0 if p == 1 else self.alpha + self.beta * (p - 1) / p * num_bytes

    def all_to_all(self, num_bytes: float) -> float:
        """All-to-all of a tensor of ``num_bytes`` in total (0 on one rank)."""
        p = self.world_size
        return 0.0 if p == 1 else self.alpha + self.beta * (p - 1) / p / p * num_bytes


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way to run one operator: layouts and predicted per-rank costs."""

    name: str
    """``dp``, ``col``, ``row``, ``rep`` for linear; the layout for elementwise/layernorm."""
    in_layout: Layout
    out_layout: Layout
    compute_s: float
    """Forward + backward compute time per rank."""
    comm_s: float
    """Communication time per step (gradient all-reduce, row/column activation all-reduce)."""
    comm_bytes: float
    """Bytes this strategy all-reduces per step (per rank, before the ring factor)."""
    param_mem: float
    """Bytes of parameters, gradients and Adam states held by one rank."""
    act_mem: float
    """Bytes of the output activation held by one rank."""
    end_mem: float = 0.0
    """Bytes this operator holds at the end of backward, when the gradients are complete and
    the activations gone (parameters, gradients, optimizer states, communication buffers); a
    plan's memory is the larger of the two moments. 0: only :attr:`memory` counts."""
    in_layouts: tuple[Layout, ...] = ()
    """Layout of each input, for operators with several (a residual add, attention); empty:
    every input takes :attr:`in_layout`."""

    def input_layout(self, index: int) -> Layout:
        """The layout this strategy needs on input ``index``."""
        return self.in_layouts[index] if self.in_layouts else self.in_layout

    @property
    def time(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def memory(self) -> float:
        return self.param_mem + self.act_mem


def classify(node: fx.Node, root: nn.Module) -> OpKind:
    """The :data:`OpKind` of a ``call_module``/``call_function`` node.

    Raises:
        UnsupportedOperatorError: the operator has no strategies.
    """
    if node.op == "call_module":
        module = root.get_submodule(str(node.target))
        if isinstance(module, nn.Linear):
            return "linear"
        if isinstance(module, nn.LayerNorm):
            return "layernorm"
        if isinstance(module, _ELEMENTWISE_MODULES) or (
            isinstance(module, nn.Dropout) and module.p == 0.0
        ):
            return "elementwise"
        what = type(module).__name__
    elif node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
        return "elementwise"
    else:
        what = getattr(node.target, "__name__", str(node.target))
    raise UnsupportedOperatorError(
        f"autoparallelize has no sharding strategies for node {node.name!r} (op {node.op}, "
        f"operator {what}). Supported: nn.Linear, nn.LayerNorm and elementwise activations in a "
        "chain (an MLP). Parallelise other models with a Booster plugin."
    )


def _layout_bytes(num_bytes: float, layout: Layout, world_size: int) -> float:
    return num_bytes if layout == "R" else num_bytes / world_size


def strategies_for(
    kind: OpKind,
    *,
    flops: float,
    param_bytes: float,
    bias_bytes: float,
    out_bytes: float,
    in_bytes: float,
    cost: CostModel,
) -> list[Strategy]:
    """The strategies of one operator of ``kind`` with the given sizes (full, unsharded)."""
    p = cost.world_size
    state = float(_STATE_COPIES)
    result: list[Strategy] = []

    def add(
        name: str,
        i: Layout,
        o: Layout,
        flop_div: float,
        comm_bytes: float,
        comm_s: float,
        params: float,
    ) -> None:
        result.append(
            Strategy(
                name=name,
                in_layout=i,
                out_layout=o,
                compute_s=cost.compute(flops / flop_div),
                comm_s=comm_s,
                comm_bytes=comm_bytes,
                param_mem=state * params,
                act_mem=_layout_bytes(out_bytes, o, p),
            )
        )

    if kind == "linear":
        add("dp", "B", "B", p, param_bytes, cost.all_reduce(param_bytes), param_bytes)
        # Column: weight rows (out features) and bias sharded; backward all-reduces the input grad.
        add("col", "R", "F", p, in_bytes, cost.all_reduce(in_bytes), param_bytes / p)
        # Row: weight columns sharded, bias whole; forward all-reduces the partial output.
        weight = param_bytes - bias_bytes
        add("row", "F", "R", p, out_bytes, cost.all_reduce(out_bytes), weight / p + bias_bytes)
        add("rep", "R", "R", 1, 0.0, 0.0, param_bytes)
    elif kind == "layernorm":
        add("B", "B", "B", p, param_bytes, cost.all_reduce(param_bytes), param_bytes)
        add("R", "R", "R", 1, 0.0, 0.0, param_bytes)
    else:
        for layout in ("B", "R", "F"):
            add(layout, layout, layout, 1, 0.0, 0.0, 0.0)
    return result


def reshard_cost(src: Layout, dst: Layout, num_bytes: float, cost: CostModel) -> float:
    """Forward + backward time to convert a tensor of ``num_bytes`` from ``src`` to ``dst``.

    Slicing a replicated tensor is free forward but all-gathers its gradient backward; gathering
    a sharded tensor all-gathers forward and slices backward; B <-> F is an all-to-all each way.
    """
    if src == dst:
        return 0.0
    if "R" in (src, dst):
        return cost.all_gather(num_bytes)
    return 2 * cost.all_to_all(num_bytes)


def param_sizes(module: nn.Module) -> tuple[float, float]:
    """(all parameter bytes, bias bytes) of a module's direct parameters."""
    total = sum(math.prod(t.shape) * t.element_size() for t in module.parameters(recurse=False))
    bias = getattr(module, "bias", None)
    bias_bytes = (
        math.prod(bias.shape) * bias.element_size() if isinstance(bias, torch.Tensor) else 0
    )
    return float(total), float(bias_bytes)
