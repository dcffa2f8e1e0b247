"""Ring self-attention (``kolossos.sequence``) on 2 and 4 gloo ranks equals full attention computed
in one process: ``RingQK``/``RingAV`` (output and the gradients of Q, K and V) and
``TransformerSelfAttentionRing`` (output, the input's gradient and the parameters' gradients
summed over the ranks), bidirectional with padding masks and causal, in fp32; and each call sends
the bytes of the closed form ``2 (P-1) N s d`` forward, ``4 (P-1) N s d`` backward."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kolossos.sequence import (
    AttnMaskType,
    RingAV,
    RingQK,
    TransformerSelfAttentionRing,
    ring_self_attention_bytes,
)
from kolossos.testing import distributed
from kolossos.utils.profiling import CommCounter

pytestmark = pytest.mark.dist

TOL: dict[str, Any] = dict(rtol=1e-5, atol=1e-5)
BATCH, HEADS, HIDDEN, SEQ = 2, 4, 16, 16
MASKS = ["none", "key_padding_bool", "key_padding_additive", "attention_mask_bool", "causal"]


def _labelled(label: str) -> Callable[[str], str]:
    """An ``assert_close`` message that names the case."""
    return lambda message: f"{label}: {message}"


def _chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's contiguous sequence chunk of ``t`` along ``dim``."""
    return t.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


def _padding(seq: int) -> torch.Tensor:
    """``[BATCH, seq]`` True at padding: sample 0 keeps 3 tokens (the last chunks are all
    padding), sample 1 keeps all but the last."""
    lengths = torch.tensor([3, seq - 1])
    return torch.arange(seq)[None, :] >= lengths[:, None]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
@distributed()
def test_ring_ops_equal_full_attention(world_size: int, causal: bool) -> None:
    torch.manual_seed(0)
    n, d = BATCH * HEADS, HIDDEN // HEADS
    q, k, v = (torch.randn(n, SEQ, d, requires_grad=True) for _ in range(3))
    weight = torch.randn(n, SEQ, d)
    hidden = _padding(SEQ).repeat_interleave(HEADS, 0)[:, None, :]  # [n, 1, S]
    if causal:
        hidden = hidden | torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
    ref = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(hidden, -math.inf)
    ref_out = ref.softmax(-1) @ v
    (ref_out * weight).sum().backward()

    q_r, k_r, v_r = (_chunk(t, 1).detach().clone().requires_grad_() for t in (q, k, v))
    group = dist.group.WORLD
    assert group is not None
    with CommCounter() as comm:
        scores = RingQK.apply(q_r, k_r, group) / math.sqrt(d)
        hidden_rows = _chunk(hidden.expand(n, SEQ, SEQ), 1)
        probs = scores.masked_fill(hidden_rows, torch.finfo(scores.dtype).min).softmax(-1)
        out = RingAV.apply(probs, v_r, group)
        forward_bytes = comm.bytes("send")
        (out * _chunk(weight, 1)).sum().backward()
    torch.testing.assert_close(out, _chunk(ref_out, 1), **TOL)
    for name, local, full in (("q", q_r, q), ("k", k_r, k), ("v", v_r, v)):
        assert full.grad is not None and local.grad is not None
        torch.testing.assert_close(local.grad, _chunk(full.grad, 1), **TOL, msg=f"grad of {name}")
    closed = ring_self_attention_bytes(n, SEQ // world_size, d, world_size)
    assert forward_bytes == pytest.approx(closed["forward"], rel=0.10)
    assert comm.bytes("send") - forward_bytes == pytest.approx(closed["backward"], rel=0.10)
    assert comm.bytes("recv") == comm.bytes("send")
    assert comm.calls("all_reduce") == comm.calls("all_gather") == 0


def _reference_layer(
    layer: TransformerSelfAttentionRing, x: torch.Tensor, hidden: torch.Tensor | None,
    additive: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Full self-attention in one process with ``layer``'s weights (Megatron's fused QKV layout:
    ``[seq, batch, heads, 3 * head_size]``)."""
    seq, batch, width = x.shape
    d = width // HEADS
    mixed = F.linear(x, layer.query_key_value.weight, layer.query_key_value.bias)
    q, k, v = (t.permute(1, 2, 0, 3) for t in mixed.view(seq, batch, HEADS, 3 * d).split(d, -1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if additive is not None:
        scores = scores + additive
    if hidden is not None:  # the lowest value, not -inf: a row with every key hidden is uniform
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
    context = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(seq, batch, width)
    return F.linear(context, layer.dense.weight), layer.dense.bias


def _masks(kind: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """``(forward kwargs for this rank, reference boolean mask, reference additive mask)``."""
    pad = _padding(SEQ)
    if kind == "key_padding_bool":
        return {"key_padding_mask": _chunk(pad, 1)}, pad[:, None, None, :], None
    if kind == "key_padding_additive":
        add = torch.zeros(BATCH, SEQ).masked_fill(pad, -1e4) + torch.rand(BATCH, SEQ)
        return {"key_padding_mask": _chunk(add, 1)}, None, add[:, None, None, :]
    if kind == "attention_mask_bool":  # Colossal-AI's [b, 1, s, S], True = hidden
        full = pad[:, None, :] | pad[:, :, None]  # padded queries see nothing: uniform rows
        return {"attention_mask": _chunk(full[:, None], 2)}, full[:, None], None
    if kind == "causal":
        return {}, torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), None
    return {}, None, None


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_layer_equals_full_attention(world_size: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    for kind in MASKS:
        torch.manual_seed(1)
        mask_type = AttnMaskType.causal if kind == "causal" else AttnMaskType.padding
        layer = TransformerSelfAttentionRing(HIDDEN, HEADS, 0.0, attn_mask_type=mask_type,
                                             group=group)  # fmt: skip
        reference = copy.deepcopy(layer)
        assert reference.group is group  # the copy shares the process group
        x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
        weight = torch.randn(SEQ, BATCH, HIDDEN)
        kwargs, hidden, additive = _masks(kind)
        ref_out, ref_bias = _reference_layer(reference, x, hidden, additive)
        ((ref_out + ref_bias) * weight).sum().backward()

        x_r = _chunk(x, 0).detach().clone().requires_grad_()
        with CommCounter() as comm:
            out, bias = layer(x_r, **kwargs)
            forward = comm.bytes("send") + comm.bytes("all_gather")
            ((out + bias) * _chunk(weight, 0)).sum().backward()
        torch.testing.assert_close(out, _chunk(ref_out, 0), **TOL, msg=_labelled(kind))
        assert x.grad is not None and x_r.grad is not None
        torch.testing.assert_close(x_r.grad, _chunk(x.grad, 0), **TOL)
        for name, p in layer.named_parameters():
            assert p.grad is not None
            total = p.grad.clone()
            dist.all_reduce(total)  # each rank holds its chunk's share of the gradient
            expected = dict(reference.named_parameters())[name].grad
            label = f"{kind} {name}"
            torch.testing.assert_close(total, expected, **TOL, msg=_labelled(label))

        closed = ring_self_attention_bytes(BATCH * HEADS, SEQ // world_size, HIDDEN // HEADS,
                                      world_size)  # fmt: skip
        mask = kwargs.get("key_padding_mask")
        gathered = 0 if mask is None else BATCH * SEQ * (1 if mask.dtype == torch.bool else 4)
        assert forward == pytest.approx(closed["forward"] + gathered, rel=0.10)
        assert comm.bytes("all_gather") == gathered
        assert comm.bytes("send") - closed["forward"] == pytest.approx(closed["backward"], rel=0.1)


@distributed(2)
def test_errors_before_any_collective() -> None:
    group = dist.group.WORLD
    assert group is not None
    layer = TransformerSelfAttentionRing(HIDDEN, HEADS, group=group)
    x = torch.randn(4, BATCH, HIDDEN)
    with CommCounter() as comm:
        with pytest.raises(ValueError, match="key_padding_mask"):
            layer(x, key_padding_mask=torch.zeros(BATCH, 5, dtype=torch.bool))
        with pytest.raises(ValueError, match="does not broadcast"):
            layer(x, attention_mask=torch.zeros(BATCH, 1, 4, 4, dtype=torch.bool))  # not 8 keys
        with pytest.raises(ValueError, match="sequence first"):
            layer(torch.randn(BATCH, 4, HIDDEN + 1))
        with pytest.raises(ValueError, match="RingAV"):
            RingAV.apply(torch.rand(8, 4, 4), torch.rand(8, 4, 4), group)  # needs 8 key columns
    assert comm.calls() == 0
    with pytest.raises(ValueError, match="not divisible"):
        TransformerSelfAttentionRing(18, 4, group=group)
    with pytest.raises(TypeError, match="ProcessGroup"):
        TransformerSelfAttentionRing(HIDDEN, HEADS, group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_dropout"):
        TransformerSelfAttentionRing(HIDDEN, HEADS, 1.5, group=group)
