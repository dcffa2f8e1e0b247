"""Column- and row-parallel linear layers (Megatron 1D), with Megatron sequence parallelism.

* :class:`Linear1D_Col` splits the output features: ``Y_i = X A_i``. The input is replicated
  (its gradient is summed over the group) or, under sequence parallelism, a sequence shard that is
  all-gathered first. The output stays split unless ``gather_output``.
* :class:`Linear1D_Row` splits the input features: ``Z = sum_i Y_i B_i``. The partial products are
  all-reduced, or reduce-scattered along the sequence under sequence parallelism.

Both keep the weight in the layout of the module they were built from (``nn.Linear``:
``(out, in)``; Hugging Face ``Conv1D``: ``(in, out)``) under the same parameter names, so a
state dict keeps its keys; each sharded parameter carries a
:class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec`.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d._base import (
    ParallelModule1D,
    check_seq_parallel_mode,
    is_conv1d,
    trainable,
)
from kolossos.nn.layer.parallel_1d._comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_reduce_scatter_grad,
    reduce_from_tp,
    reduce_scatter_seq_gather_grad,
    split_to_tp,
)
from kolossos.nn.layer.parallel_1d.sharding import mark_sequence_parallel

__all__ = ["Linear1D_Col", "Linear1D_Row", "native_linear_weights"]

LinearOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]
_L = TypeVar("_L", bound="_Linear1D")


def _default_full_weights(
    in_features: int,
    out_features: int,
    bias: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights initialised exactly as ``nn.Linear(in_features, out_features)`` would be (same
    random draws), so a layer built after the same seed equals the dense layer."""
    dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    return dense.weight.detach(), None if dense.bias is None else dense.bias.detach()


def native_linear_weights(
    module: nn.Module,
) -> tuple[int, int, torch.Tensor, torch.Tensor | None, bool]:
    """``(in_features, out_features, weight, bias, conv1d_layout)`` of an ``nn.Linear`` or a
    Hugging Face ``Conv1D``.

    Raises:
        TypeError: ``module`` is neither.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, module.weight, module.bias, False
    if is_conv1d(module):
        weight = module.weight
        bias = getattr(module, "bias", None)
        assert isinstance(weight, torch.Tensor)
        return weight.shape[0], weight.shape[1], weight, bias, True
    raise TypeError(
        f"expected an nn.Linear or a transformers Conv1D, got {type(module).__name__}; "
        "convert the module first or build the layer with its constructor."
    )


class _Linear1D(ParallelModule1D):
    """Shared construction of the two linear layers."""

    _split_linear_dim: int  # dim of an (out, in) weight that is split

    def _build(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        weight: torch.Tensor | None,
        bias_: torch.Tensor | None,
        conv1d_layout: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        fused_sections: tuple[int, ...] | None = None,
    ) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.conv1d_layout = conv1d_layout
        if weight is None:
            weight, bias_ = _default_full_weights(in_features, out_features, bias, device, dtype)
            if conv1d_layout:
                weight = weight.t()
        expected = (in_features, out_features) if conv1d_layout else (out_features, in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}: weight of shape {tuple(weight.shape)} does not match "
                f"in_features={in_features}, out_features={out_features} (expected {expected})."
            )
        dim = self._split_linear_dim
        weight_dim = 1 - dim if conv1d_layout else dim
        self.weight = self._shard_param(
            weight, weight_dim, fused_sections=fused_sections, requires_grad=trainable(weight)
        )
        if not bias:
            if bias_ is not None:
                raise ValueError(
                    f"{type(self).__name__}: bias=False but a bias_ tensor was given; pass "
                    "bias=True to use it."
                )
            self.register_parameter("bias", None)
            return
        if bias_ is None:  # nn.Linear's bias initialisation
            bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
            bias_ = torch.empty(out_features, device=weight.device, dtype=weight.dtype)
            bias_.uniform_(-bound, bound)
        bias_dim = 0 if dim == 0 else None  # column: split; row: replicated
        self.bias = self._shard_param(
            bias_, bias_dim, fused_sections=fused_sections, requires_grad=trainable(bias_)
        )

    @classmethod
    def from_native_module(
        cls: type[_L], module: nn.Module, process_group: ProcessGroup | None = None, **options: Any
    ) -> _L:
        """Build from an ``nn.Linear`` or transformers ``Conv1D``, slicing its weights.

        ``options`` are the constructor's keyword arguments (:class:`Linear1D_Col`:
        ``gather_output``, ``seq_parallel_mode``, ``seq_dim``, ``skip_bias_add``,
        ``input_comm``, ``fused_sections``; :class:`Linear1D_Row`: ``parallel_input``,
        ``seq_parallel_mode``, ``seq_dim``, ``skip_bias_add``).
        """
        in_f, out_f, weight, bias, conv1d = native_linear_weights(module)
        return cls(
            in_f,
            out_f,
            bias is not None,
            process_group=process_group,
            weight=weight,
            bias_=bias,
            conv1d_layout=conv1d,
            **options,
        )

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight.t() if self.conv1d_layout else self.weight
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_size={self.tp_size}, "
            f"seq_parallel_mode={self.seq_parallel_mode}, conv1d_layout={self.conv1d_layout}"
        )

    seq_parallel_mode: str | None


class Linear1D_Col(_Linear1D):
    """Linear layer with the output features split over the tensor-parallel group.

    Args:
        in_features: input size.
        out_features: full output size (divisible by the group size).
        bias: whether the layer has a bias (split like the output).
        device: where to create the weights when ``weight`` is not given.
        dtype: their dtype.
        process_group: the tensor-parallel group (default: the world).
        gather_output: all-gather the output features so every rank has the full output.
        seq_parallel_mode: ``"split_gather"``: the input is a shard along ``seq_dim`` and is
            all-gathered (its gradient reduce-scattered); ``None``: the input is replicated.
        seq_dim: the sequence dimension of the input under sequence parallelism.
        skip_bias_add: return ``(output, bias)`` without adding the bias (for fusion).
        input_comm: ``False``: the caller already made the input full and replicated (one
            ``copy_to_tp`` / ``gather_seq_reduce_scatter_grad`` at a block's input shared by q, k
            and v): no communication here, and the input gradient is this rank's partial sum,
            summed by the caller's collective. Incompatible with ``seq_parallel_mode``.
        fused_sections: sizes of fused output blocks (q, k, v), each split evenly, so each rank
            gets its part of every block.
        weight: the full weight to shard (default: initialised as ``nn.Linear`` would).
        bias_: the full bias to shard.
        conv1d_layout: ``weight`` is stored ``(in, out)`` as in transformers' ``Conv1D``.

    Example:
        >>> col = Linear1D_Col.from_native_module(nn.Linear(8, 16), group)  # doctest: +SKIP
        >>> col(torch.randn(2, 8)).shape  # with 2 ranks  # doctest: +SKIP
        torch.Size([2, 8])
    """

    _split_linear_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        process_group: ProcessGroup | None = None,
        gather_output: bool = False,
        seq_parallel_mode: str | None = None,
        seq_dim: int = 1,
        skip_bias_add: bool = False,
        input_comm: bool = True,
        fused_sections: tuple[int, ...] | None = None,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        conv1d_layout: bool = False,
    ) -> None:
        super().__init__()
        if skip_bias_add and gather_output:
            raise NotImplementedError(
                "Linear1D_Col: skip_bias_add=True with gather_output=True is not supported (the "
                "returned bias would be a shard); add the bias yourself or keep the output split."
            )
        if not input_comm and seq_parallel_mode is not None:
            raise ValueError(
                f"Linear1D_Col: input_comm=False means the input arrives already gathered, so "
                f"seq_parallel_mode={seq_parallel_mode!r} cannot apply; pass None."
            )
        self.seq_parallel_mode = check_seq_parallel_mode(seq_parallel_mode)
        self.seq_dim, self.gather_output, self.skip_bias_add = seq_dim, gather_output, skip_bias_add
        self.input_comm = input_comm
        self.fused_sections = None if fused_sections is None else tuple(fused_sections)
        self._init_group(process_group)
        self._build(
            in_features,
            out_features,
            bias,
            weight,
            bias_,
            conv1d_layout,
            device,
            dtype,
            self.fused_sections,
        )

    def _gather(self, y: torch.Tensor) -> torch.Tensor:
        full = gather_from_tp(y, self.process_group, dim=-1)
        if self.fused_sections is None or self.tp_size == 1:
            return full
        # Rank-major [q0 k0 v0 | q1 k1 v1] -> block-major [q0 q1 | k0 k1 | v0 v1].
        local = [s // self.tp_size for s in self.fused_sections]
        per_rank = [chunk.split(local, dim=-1) for chunk in full.chunk(self.tp_size, dim=-1)]
        blocks = [per_rank[r][b] for b in range(len(local)) for r in range(self.tp_size)]
        return torch.cat(blocks, dim=-1)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        if self.seq_parallel_mode is not None:
            x = gather_seq_reduce_scatter_grad(x, self.process_group, self.seq_dim)
        elif self.input_comm:
            x = copy_to_tp(x, self.process_group)
        y = self._matmul(x, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = self._gather(y)
        return (y, self.bias) if self.skip_bias_add else y


class Linear1D_Row(_Linear1D):
    """Linear layer with the input features split over the tensor-parallel group; the partial
    outputs are summed (all-reduce, or reduce-scatter along ``seq_dim`` under sequence
    parallelism). The bias is replicated and added after the reduction.

    Args:
        in_features: full input size (divisible by the group size).
        out_features: output size.
        bias: whether the layer has a bias.
        device: where to create the weights when ``weight`` is not given.
        dtype: their dtype.
        process_group: the tensor-parallel group (default: the world).
        parallel_input: the input is already split along its last dimension (the output of a
            :class:`Linear1D_Col`); ``False`` splits a replicated input here.
        seq_parallel_mode: ``"split_gather"``: reduce-scatter the output along ``seq_dim`` (the
            bias is then marked sequence-parallel: its gradient needs a sum over the group).
        seq_dim: the sequence dimension of the output under sequence parallelism.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        weight: the full weight to shard (default: initialised as ``nn.Linear`` would).
        bias_: the full bias.
        conv1d_layout: ``weight`` is stored ``(in, out)`` as in transformers' ``Conv1D``.
    """

    _split_linear_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        process_group: ProcessGroup | None = None,
        parallel_input: bool = True,
        seq_parallel_mode: str | None = None,
        seq_dim: int = 1,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        conv1d_layout: bool = False,
    ) -> None:
        super().__init__()
        self.seq_parallel_mode = check_seq_parallel_mode(seq_parallel_mode)
        self.seq_dim, self.parallel_input = seq_dim, parallel_input
        self.skip_bias_add = skip_bias_add
        self._init_group(process_group)
        self._build(in_features, out_features, bias, weight, bias_, conv1d_layout, device, dtype)
        if self.bias is not None and self.seq_parallel_mode is not None:
            mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        if not self.parallel_input:
            x = split_to_tp(x, self.process_group, dim=-1)
        y = self._matmul(x, None)
        if self.seq_parallel_mode is not None:
            y = reduce_scatter_seq_gather_grad(y, self.process_group, self.seq_dim)
        else:
            y = reduce_from_tp(y, self.process_group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias
