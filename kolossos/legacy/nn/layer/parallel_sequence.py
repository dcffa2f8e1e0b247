"""Colossal-AI's ``colossalai.legacy.nn.layer.parallel_sequence``: ring self-attention over the
launch's ``ParallelMode.SEQUENCE`` group.

The algorithm lives in :mod:`kolossos.sequence.ring_self_attention`, which takes an explicit
process group; this module supplies ``gpc``'s sequence group (built by
``parallel=dict(tensor=dict(size=N, mode="sequence"))``) and keeps Colossal-AI's call forms:
``RingQK.apply(sub_q, sub_k, batch_size, num_attention_heads, sub_seq_length)``,
``RingAV.apply(attention_score, sub_v, batch_size, num_attention_heads, attention_head_size,
sub_seq_length)`` and ``TransformerSelfAttentionRing(hidden_size, num_attention_heads,
attention_dropout, attention_mask_func, layer_number, ...)``.

One difference from Colossal-AI: its ``RingQK``/``RingAV`` divide the gradients of Q, K and V by
the sequence-parallel size; kolossos returns the exact gradients of full attention, so a
sequence-parallel run trains the same model as one process (see ``docs/sequence_parallel.md``).

Example:
    >>> # config.py: parallel = dict(tensor=dict(size=2, mode="sequence"))
    >>> attn = TransformerSelfAttentionRing(128, 4, 0.1, None, 1)  # doctest: +SKIP
    >>> out, bias = attn(hidden_chunk, attention_mask)  # [s/P, b, 128], [b, 1, s/P, s]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kolossos.legacy.context import ParallelMode
from kolossos.legacy.context.random import get_seeds, seed
from kolossos.legacy.core import global_context as gpc
from kolossos.legacy.registry import LAYERS
from kolossos.sequence import ring_self_attention as _rsa
from kolossos.sequence.ring_self_attention import AttnMaskType, MaskFunc

__all__ = ["AttnMaskType", "RingAV", "RingQK", "TransformerSelfAttentionRing"]


def sequence_group() -> dist.ProcessGroup:
    """``gpc``'s ``ParallelMode.SEQUENCE`` group, or a clear error when the launch made none."""
    if not gpc.is_initialized(ParallelMode.SEQUENCE):
        raise RuntimeError(
            "ring self-attention needs the sequence-parallel group: launch with "
            "parallel=dict(tensor=dict(size=N, mode='sequence')), or use "
            "kolossos.sequence.TransformerSelfAttentionRing(..., group=<your group>)."
        )
    return gpc.get_group(ParallelMode.SEQUENCE)


def _check_rows(name: str, tensor: torch.Tensor, batch_size: int, heads: int, sub_seq: int) -> None:
    expected = (batch_size * heads, sub_seq)
    if tensor.dim() != 3 or tuple(tensor.shape[:2]) != expected:
        raise ValueError(
            f"{name} {tuple(tensor.shape)} must be [batch_size * num_attention_heads, "
            f"sub_seq_length, ...] = [{expected[0]}, {expected[1]}, ...]."
        )


class RingQK:
    """Colossal-AI's ``RingQK``: ``RingQK.apply(sub_q, sub_k, batch_size, num_attention_heads,
    sub_seq_length)`` → scores ``[batch*heads, sub_seq, seq]`` over ``gpc``'s sequence group
    (:class:`kolossos.sequence.RingQK`)."""

    @staticmethod
    def apply(
        sub_q: torch.Tensor,
        sub_k: torch.Tensor,
        batch_size: int,
        num_attention_heads: int,
        sub_seq_length: int,
    ) -> torch.Tensor:
        """Ring ``Q Kᵀ`` (a collective over ``ParallelMode.SEQUENCE``)."""
        for name, t in (("sub_q", sub_q), ("sub_k", sub_k)):
            _check_rows(name, t, batch_size, num_attention_heads, sub_seq_length)
        out: torch.Tensor = _rsa.RingQK.apply(sub_q, sub_k, sequence_group())
        return out


class RingAV:
    """Colossal-AI's ``RingAV``: ``RingAV.apply(attention_score, sub_v, batch_size,
    num_attention_heads, attention_head_size, sub_seq_length)`` → ``[batch*heads, sub_seq,
    head_size]`` over ``gpc``'s sequence group (:class:`kolossos.sequence.RingAV`)."""

    @staticmethod
    def apply(
        attention_score: torch.Tensor,
        sub_v: torch.Tensor,
        batch_size: int,
        num_attention_heads: int,
        attention_head_size: int,
        sub_seq_length: int,
    ) -> torch.Tensor:
        """Ring ``probs · V`` (a collective over ``ParallelMode.SEQUENCE``)."""
        _check_rows("attention_score", attention_score, batch_size, num_attention_heads,
                    sub_seq_length)  # fmt: skip
        _check_rows("sub_v", sub_v, batch_size, num_attention_heads, sub_seq_length)
        if sub_v.shape[2] != attention_head_size:
            raise ValueError(
                f"sub_v {tuple(sub_v.shape)} must have attention_head_size={attention_head_size} "
                "as its last dimension."
            )
        out: torch.Tensor = _rsa.RingAV.apply(attention_score, sub_v, sequence_group())
        return out


@LAYERS.register_module
class TransformerSelfAttentionRing(_rsa.TransformerSelfAttentionRing):
    """Colossal-AI's ``TransformerSelfAttentionRing``: :class:`kolossos.sequence.
    TransformerSelfAttentionRing` over ``gpc``'s ``ParallelMode.SEQUENCE`` group (or ``group``),
    with the attention dropout drawn from ``ParallelMode.TENSOR``'s random stream, as upstream.

    Args are Colossal-AI's (``attention_mask_func`` and ``layer_number`` may be left out);
    ``group``, ``device`` and ``dtype`` are keyword-only additions. ``forward(hidden_states,
    attention_mask=None, key_padding_mask=None)`` as the core layer.

    Raises:
        RuntimeError: no ``group`` and the launch built no sequence-parallel group.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        attention_dropout: float = 0.0,
        attention_mask_func: MaskFunc | None = None,
        layer_number: int = 1,
        apply_query_key_layer_scaling: bool = False,
        convert_fp16_to_fp32_in_softmax: bool = False,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        masked_softmax_fusion: bool = True,
        fp16: bool = False,
        bf16: bool = False,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            hidden_size,
            num_attention_heads,
            attention_dropout,
            attention_mask_func,
            layer_number,
            apply_query_key_layer_scaling,
            convert_fp16_to_fp32_in_softmax,
            attn_mask_type,
            masked_softmax_fusion,
            fp16,
            bf16,
            group=sequence_group() if group is None else group,
            device=device,
            dtype=dtype,
        )

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        if not self.training or self.attention_dropout.p == 0.0:
            return probs
        if ParallelMode.TENSOR not in get_seeds():  # no parallel config: the default stream
            return self.attention_dropout(probs)
        with seed(ParallelMode.TENSOR):
            return self.attention_dropout(probs)
