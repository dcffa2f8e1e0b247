"""The transformer :mod:`benchmarks.sequence_parallel` measures, one variant per parallel mode.

A stack of pre-LN blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` (MLP 4h, GELU, causal
attention, no dropout, fp32) fed with random hidden states (the embedding's output) and closed
by the mean square of the output (a loss that needs no vocabulary). Only the attention and where
the sequence lives differ between the modes:

* ``single``: one process, the whole sequence, PyTorch SDPA (``is_causal=True``; on the CPU its
  flash kernel keeps the log-sum-exp, not the scores).
* ``tp``: Megatron 1D tensor parallelism over ``P`` ranks (``Linear1D_Col`` q/k/v and MLP-up,
  ``Linear1D_Row`` attention-out and MLP-down, heads split), SDPA on this rank's heads; every
  rank holds the whole sequence; layer norms, residuals and the block inputs are replicated.
* ``single_eager``, ``tp_eager``: the same with attention written out (scores, causal mask,
  softmax, times V: the ``b·a·S²`` probabilities are kept for backward), as Megatron computed it
  when the sequence-parallelism paper compared against it, and as ring self-attention does.
* ``rsa``: ring self-attention (:class:`~kolossos.sequence.TransformerSelfAttentionRing`,
  causal), every rank holds ``S/P`` contiguous tokens.
* ``ulysses``: :func:`~kolossos.sequence.ulysses_attention` (``causal=True``) on ``S/P`` tokens.
* ``ring_attn``: :func:`~kolossos.sequence.ring_attention` (``causal=True``, zig-zag layout) on
  ``S/P`` tokens.
* ``torch_cp``: the ``single`` model under PyTorch's
  ``torch.distributed.tensor.experimental.context_parallel`` (input sharded on the sequence).

The sequence modes keep every parameter on every rank (their gradients are averaged over the
group after backward, as DDP would).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODES", "SEQUENCE_MODES", "Shape", "build", "local_tokens", "make_input"]

#: every mode, in table order
MODES = ("single", "single_eager", "tp", "tp_eager", "rsa", "ulysses", "ring_attn", "torch_cp")
#: the modes that split the sequence (activation memory ∝ 1/P expected)
SEQUENCE_MODES = ("rsa", "ulysses", "ring_attn")


@dataclass(frozen=True)
class Shape:
    """The model's size (the sequence length is chosen per measurement)."""

    hidden: int = 64
    heads: int = 8
    layers: int = 2
    batch: int = 1


class _Attention(nn.Module):
    """q/k/v projection, an attention kernel over ``(batch, heads, tokens, dim)``, projection."""

    def __init__(self, shape: Shape, kernel: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.heads, self.kernel = shape.heads, kernel
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.out = nn.Linear(shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = self.kernel(q, k, v)  # (b, heads, s, dim)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class _TPAttention(nn.Module):
    """Megatron attention: column-parallel q/k/v (this rank's heads), row-parallel output."""

    def __init__(
        self, shape: Shape, group: dist.ProcessGroup, kernel: Callable[..., torch.Tensor]
    ) -> None:
        from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row

        super().__init__()
        self.kernel = kernel
        tp = dist.get_world_size(group)
        self.heads = shape.heads // tp
        self.head_dim = shape.hidden // shape.heads
        self.qkv = Linear1D_Col(shape.hidden, 3 * shape.hidden, process_group=group)
        self.out = Linear1D_Row(shape.hidden, shape.hidden, process_group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # the local 3h/P features are this rank's q, k and v of its heads (layout immaterial here)
        qkv = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = self.kernel(qkv[0], qkv[1], qkv[2])
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        return out


class _RSAAttention(nn.Module):
    """Ring self-attention; the layer works sequence-first and returns the bias apart."""

    def __init__(self, shape: Shape, group: dist.ProcessGroup) -> None:
        from kolossos.sequence import AttnMaskType, TransformerSelfAttentionRing

        super().__init__()
        self.layer = TransformerSelfAttentionRing(
            shape.hidden, shape.heads, 0.0, attn_mask_type=AttnMaskType.causal, group=group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.layer(x.transpose(0, 1))
        return (out + bias).transpose(0, 1)


class _Block(nn.Module):
    def __init__(self, shape: Shape, attn: nn.Module, mlp: tuple[nn.Module, nn.Module]) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(shape.hidden), nn.LayerNorm(shape.hidden)
        self.attn, self.up, self.down = attn, *mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out: the probabilities are materialised and kept."""
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    hidden = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


def _kernel(mode: str, group: dist.ProcessGroup | None) -> Callable[..., torch.Tensor]:
    if mode.endswith("_eager"):
        return _eager
    if mode in ("single", "tp", "torch_cp"):
        return _sdpa
    if mode == "ulysses":
        from kolossos.sequence import ulysses_attention

        return lambda q, k, v: ulysses_attention(q, k, v, group, causal=True)
    from kolossos.sequence import ring_attention

    return lambda q, k, v: ring_attention(q, k, v, group, causal=True, layout="zigzag")


def build(mode: str, shape: Shape, group: dist.ProcessGroup | None) -> nn.Sequential:
    """The model of ``mode`` (same seed on every rank: replicated parameters agree)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}.")
    blocks = []
    h = shape.hidden
    for _ in range(shape.layers):
        attn: nn.Module
        mlp: tuple[nn.Module, nn.Module]
        if mode.startswith("tp"):
            from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row

            assert group is not None
            attn = _TPAttention(shape, group, _kernel(mode, group))
            mlp = (
                Linear1D_Col(h, 4 * h, process_group=group),
                Linear1D_Row(4 * h, h, process_group=group),
            )
        elif mode == "rsa":
            assert group is not None
            attn = _RSAAttention(shape, group)
        else:
            attn = _Attention(shape, _kernel(mode, group))
        if not mode.startswith("tp"):
            mlp = (nn.Linear(h, 4 * h), nn.Linear(4 * h, h))
        blocks.append(_Block(shape, attn, mlp))
    return nn.Sequential(*blocks)


def local_tokens(mode: str, seq: int, world: int) -> int:
    """Tokens of the sequence one rank holds outside attention."""
    return seq // world if mode in SEQUENCE_MODES else seq


@contextlib.contextmanager
def _torch_cp(x: torch.Tensor, world: int) -> Iterator[None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(x.device.type, (world,))
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        yield


def make_input(
    mode: str, shape: Shape, seq: int, world: int, device: torch.device
) -> tuple[torch.Tensor, contextlib.AbstractContextManager[Any]]:
    """This rank's input (created here, so a memory tracker counts it) and the context the
    forward and backward must run in; ``torch_cp`` shards the full input inside it."""
    tokens = seq if mode == "torch_cp" else local_tokens(mode, seq, world)
    x = torch.randn(shape.batch, tokens, shape.hidden, device=device)
    ctx: contextlib.AbstractContextManager[Any] = (
        _torch_cp(x, world) if mode == "torch_cp" else contextlib.nullcontext()
    )
    return x, ctx
