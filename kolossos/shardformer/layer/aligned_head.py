"""The LM head's matrix products over a vocabulary padded to an aligned size, without padding
the parameter.

A vocabulary such as GPT-2's 50257 rows makes every product of the head have an odd dimension;
cuBLAS then falls back to kernels for unaligned operands, several times slower than the rest of
the model's (measured on an H200 for a 1B GPT-2 in bf16: the head's three products ran at about
120 TFLOP/s against about 770 for the blocks' and took 43% of the step's matrix time;
``docs/benchmarks.md``). Under tensor parallelism the vocabulary-parallel head is padded already
(``make_vocab_size_divisible_by``). Without it, :class:`AlignedLMHead` computes
``F.linear(x, pad(weight))[..., :vocab]``, made contiguous (callers flatten logits with
``.view``): the weight gains zero rows for the product only, so the parameter, its name, its tie
to the embedding, checkpoints and optimizer states keep the model's own shape; the extra logits
are dropped and their (zero) gradients never reach the weight. The padded copy of the weight,
the slice of its gradient and the copy of the logits are a few passes over memory (about a
millisecond for that model at 16 × 1024 tokens) against the tens of milliseconds saved. On the
CPU the plain product is used (no alignment penalty to avoid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AlignedLMHead", "align_lm_head"]


class AlignedLMHead(nn.Linear):
    """``nn.Linear`` whose CUDA product runs over ``multiple``-aligned output rows (module doc).
    Made from an existing head by :func:`align_lm_head`, never constructed directly."""

    multiple: int = 64
    devices: tuple[str, ...] = ("cuda",)
    """device types whose products are padded"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = -self.out_features % self.multiple
        if pad == 0 or x.device.type not in self.devices:
            return F.linear(x, self.weight, self.bias)
        weight = F.pad(self.weight, (0, 0, 0, pad))
        bias = None if self.bias is None else F.pad(self.bias, (0, pad))
        return F.linear(x, weight, bias)[..., : self.out_features].contiguous()


def align_lm_head(head: nn.Module, multiple: int) -> bool:
    """Make ``head`` (an ``nn.Linear``) an :class:`AlignedLMHead` in place when its output size
    is not a multiple of ``multiple``; parameters and hooks are kept. Returns whether it did."""
    if type(head) is not nn.Linear or head.out_features % multiple == 0:
        return False
    head.__class__ = AlignedLMHead
    head.multiple = multiple  # type: ignore[assignment]
    return True
