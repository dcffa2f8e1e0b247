"""Column- and row-parallel linear layers (Megatron 1D), with Megatron sequence parallelism.

* :class:`Linear1D_Col` splits the output features: ``Y_i = X A_i``, from a replicated input or,
  under sequence parallelism, an all-gathered sequence shard; split unless ``gather_output``.
* :class:`Linear1D_Row` splits the input features: ``Z = sum_i Y_i B_i``, all-reduced (or
  reduce-scattered along the sequence under sequence parallelism; as a ring under ``'ring'``).

Both keep the weight in the layout of the module they were built from (``nn.Linear``: ``(out,
in)``; Hugging Face ``Conv1D``: ``(in, out)``) under the same parameter names; each sharded
parameter carries a :class:`~kolossos.nn.layer.parallel_1d.sharding.TPShardSpec`.
"""

from __future__ import annotations

import torch

from kolossos.nn.layer.parallel_1d._base import GroupArg, resolve_seq_parallel
from kolossos.nn.layer.parallel_1d._comm import (
    copy_to_tp,
    gather_from_tp,
    gather_seq_reduce_scatter_grad,
    reduce_from_tp,
    reduce_scatter_seq_gather_grad,
    split_to_tp,
)
from kolossos.nn.layer.parallel_1d._linear_base import (
    LinearOutput,
    _Linear1D,
    native_linear_weights,
)
from kolossos.nn.layer.parallel_1d.initializers import Initializer
from kolossos.nn.layer.parallel_1d.overlap import chunked_row_linear, overlapped_column_linear
from kolossos.nn.layer.parallel_1d.ring_ops import ring_gather_linears, ring_linear_reduce_scatter
from kolossos.nn.layer.parallel_1d.sharding import mark_sequence_parallel

__all__ = ["Linear1D_Col", "Linear1D_Row", "native_linear_weights"]


class Linear1D_Col(_Linear1D):
    """Linear layer with the output features split over the tensor-parallel group.

    The positional order is Colossal-AI's; kolossos' own options are keyword-only.

    Args:
        in_features: input size.
        out_features: full output size (divisible by the group size).
        bias: whether the layer has a bias (split like the output).
        dtype: dtype of the weights (given weights are cast to it).
        device: where the weights live (given weights are moved there).
        process_group: the tensor-parallel group (default: the world).
        gather_output: all-gather the output features so every rank has the full output.
        seq_parallel: Colossal-AI's switch for ``seq_parallel_mode="split_gather"``.
        seq_parallel_dim: Colossal-AI's name of ``seq_dim`` (default 1).
        overlap: overlap the backward communication with the weight gradient (under sequence
            parallelism the input is all-gathered again in backward, next to the input-gradient
            matmul, instead of being stored; see :mod:`~kolossos.nn.layer.parallel_1d.overlap`).
            Same numbers as without it.
        skip_bias_add: return ``(output, bias)`` without adding the bias (for fusion).
        weight: the full weight to shard (default: initialised as ``nn.Linear`` would).
        bias_: the full bias to shard.
        weight_initializer: ``init(shard, fan_in=in_features, fan_out=out_features)`` filling
            this rank's weight shard (Colossal-AI's ``colossalai.nn.init`` style), drawn on the
            per-rank random stream; only when ``weight`` is not given.
        bias_initializer: ``init(shard, fan_in=in_features)`` for the bias shard.
        seq_parallel_mode: ``"split_gather"``: the input is a shard along ``seq_dim`` and is
            all-gathered (its gradient reduce-scattered); ``"ring"``: the same around a ring,
            each chunk multiplied as it arrives (``ring_ops``); ``None``: replicated input.
        seq_dim: the sequence dimension of the input under sequence parallelism.
        input_comm: ``False``: the caller already made the input full and replicated (one
            ``copy_to_tp`` / ``gather_seq_reduce_scatter_grad`` at a block's input shared by q, k
            and v): no communication here, and the input gradient is this rank's partial sum,
            summed by the caller's collective. Incompatible with ``seq_parallel_mode`` and
            ``overlap``.
        fused_sections: sizes of fused output blocks (q, k, v), each split evenly, so each rank
            gets its part of every block.
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
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: GroupArg = None,
        gather_output: bool = False,
        seq_parallel: bool = False,
        seq_parallel_dim: int = 1,
        overlap: bool | None = None,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        *,
        seq_parallel_mode: str | None = None,
        seq_dim: int | None = None,
        input_comm: bool = True,
        fused_sections: tuple[int, ...] | None = None,
        conv1d_layout: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if skip_bias_add and gather_output:
            raise NotImplementedError(
                f"{name}: skip_bias_add=True with gather_output=True is not supported (the "
                "returned bias would be a shard); add the bias yourself or keep the output split."
            )
        self.seq_parallel_mode, self.seq_dim = resolve_seq_parallel(
            name, seq_parallel_mode, seq_parallel, seq_dim, seq_parallel_dim
        )
        self.overlap = bool(overlap)
        if not input_comm and (self.seq_parallel_mode is not None or self.overlap):
            raise ValueError(
                f"{name}: input_comm=False means the input arrives already gathered, so "
                f"seq_parallel_mode={self.seq_parallel_mode!r} / overlap={overlap!r} cannot "
                "apply; drop them."
            )
        if self.overlap and self.seq_parallel_mode == "ring":
            raise NotImplementedError(
                f"{name}: overlap=True with seq_parallel_mode='ring': the ring already overlaps "
                "every exchange with a matmul; drop overlap, or use 'split_gather' with it."
            )
        self.seq_parallel = self.seq_parallel_mode is not None
        self.seq_parallel_dim = self.seq_dim
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
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
            weight_initializer,
            bias_initializer,
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
        bias = None if self.skip_bias_add else self.bias
        if self.overlap:
            y = overlapped_column_linear(
                x,
                self.weight,
                bias,
                self.process_group,
                seq_dim=self.seq_dim if self.seq_parallel_mode is not None else None,
                conv1d_layout=self.conv1d_layout,
            )
        elif self.seq_parallel_mode == "ring":
            weight = self.weight.t() if self.conv1d_layout else self.weight
            _, (y,) = ring_gather_linears(x, [weight], [bias], self.process_group, self.seq_dim)
        else:
            if self.seq_parallel_mode is not None:
                x = gather_seq_reduce_scatter_grad(x, self.process_group, self.seq_dim)
            elif self.input_comm:
                x = copy_to_tp(x, self.process_group)
            y = self._matmul(x, bias)
        if self.gather_output:
            y = self._gather(y)
        return (y, self.bias) if self.skip_bias_add else y


class Linear1D_Row(_Linear1D):
    """Linear layer with the input features split over the tensor-parallel group; the partial
    outputs are summed (all-reduce, or reduce-scatter along ``seq_dim`` under sequence
    parallelism). The bias is replicated and added after the reduction.

    The positional order is Colossal-AI's; kolossos' own options are keyword-only.

    Args:
        in_features: full input size (divisible by the group size).
        out_features: output size.
        bias: whether the layer has a bias.
        dtype: dtype of the weights (given weights are cast to it).
        device: where the weights live (given weights are moved there).
        process_group: the tensor-parallel group (default: the world).
        seq_parallel: Colossal-AI's switch for ``seq_parallel_mode="split_gather"``.
        seq_parallel_dim: Colossal-AI's name of ``seq_dim`` (default 1).
        parallel_input: the input is already split along its last dimension (the output of a
            :class:`Linear1D_Col`); ``False`` splits a replicated input here.
        skip_bias_add: return ``(output, bias)`` without adding the bias.
        weight: the full weight to shard (default: initialised as ``nn.Linear`` would).
        bias_: the full bias.
        weight_initializer: ``init(shard, fan_in=in_features, fan_out=out_features)`` filling
            this rank's weight shard, drawn on the per-rank random stream; only when ``weight``
            is not given.
        bias_initializer: ``init(bias, fan_in=in_features)`` for the (replicated) bias, drawn
            on the replicated stream: the same bias on every rank.
        stream_chunk_num: inference only: split the output features into this many chunks whose
            all-reduces are issued asynchronously, one per chunk (a ``RuntimeError`` in training
            mode, as in Colossal-AI).
        seq_parallel_mode: ``"split_gather"``: reduce-scatter the output along ``seq_dim`` (the
            bias is then marked sequence-parallel: its gradient needs a sum over the group);
            ``"ring"``: the same, summed around a ring while the next chunk is multiplied.
        seq_dim: the sequence dimension of the output under sequence parallelism.
        conv1d_layout: ``weight`` is stored ``(in, out)`` as in transformers' ``Conv1D``.
    """

    _split_linear_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: GroupArg = None,
        seq_parallel: bool = False,
        seq_parallel_dim: int = 1,
        parallel_input: bool = True,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        stream_chunk_num: int = 1,
        *,
        seq_parallel_mode: str | None = None,
        seq_dim: int | None = None,
        conv1d_layout: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.seq_parallel_mode, self.seq_dim = resolve_seq_parallel(
            name, seq_parallel_mode, seq_parallel, seq_dim, seq_parallel_dim
        )
        self.seq_parallel = self.seq_parallel_mode is not None
        self.seq_parallel_dim = self.seq_dim
        if isinstance(stream_chunk_num, bool) or not isinstance(stream_chunk_num, int):
            raise TypeError(f"{name}: stream_chunk_num={stream_chunk_num!r} must be an int >= 1.")
        if stream_chunk_num < 1:
            raise ValueError(f"{name}: stream_chunk_num={stream_chunk_num} must be >= 1.")
        if stream_chunk_num > 1 and self.seq_parallel:
            raise NotImplementedError(
                f"{name}: stream_chunk_num={stream_chunk_num} (chunked all-reduce for inference) "
                "cannot be combined with sequence parallelism; use stream_chunk_num=1."
            )
        self.stream_chunk_num = stream_chunk_num
        self.parallel_input, self.skip_bias_add = parallel_input, skip_bias_add
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
            weight_initializer=weight_initializer,
            bias_initializer=bias_initializer,
        )
        if self.bias is not None and self.seq_parallel_mode is not None:
            mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        if not self.parallel_input:
            x = split_to_tp(x, self.process_group, dim=-1)
        if self.stream_chunk_num > 1:
            if self.training:
                raise RuntimeError(
                    f"{type(self).__name__}: stream_chunk_num={self.stream_chunk_num} is for "
                    "inference only; call .eval() or build the layer with stream_chunk_num=1."
                )
            weight = self.weight.t() if self.conv1d_layout else self.weight
            y = chunked_row_linear(x, weight, self.stream_chunk_num, self.process_group)
        elif self.seq_parallel_mode == "ring":
            weight = self.weight.t() if self.conv1d_layout else self.weight
            y = ring_linear_reduce_scatter(x, weight, self.process_group, self.seq_dim)
        else:
            y = self._matmul(x, None)
            if self.seq_parallel_mode is not None:
                y = reduce_scatter_seq_gather_grad(y, self.process_group, self.seq_dim)
            else:
                y = reduce_from_tp(y, self.process_group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias
