"""Noisy gating: random perturbations of the router logits during training.

* :class:`NormalNoiseGenerator` adds Gaussian noise of standard deviation ``1 / E**2``
  (``E`` experts), as V-MoE does.
* :class:`UniformNoiseGenerator` multiplies by a uniform jitter in ``[1 - eps, 1 + eps]``, as the
  Switch Transformer does ("makes models more resilient to rounding errors").

Both draw from torch's global generator of the logits' device, so a seeded run is reproducible.
"""

from __future__ import annotations

import torch

__all__ = ["NormalNoiseGenerator", "UniformNoiseGenerator"]


class NormalNoiseGenerator:
    """``logits + N(0, (1 / num_experts**2)**2)``.

    Args:
        num_experts: the number of experts ``E``.

    Example:
        >>> noisy = NormalNoiseGenerator(4)(torch.zeros(3, 4))
        >>> noisy.shape
        torch.Size([3, 4])
    """

    def __init__(self, num_experts: int) -> None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(
                f"NormalNoiseGenerator(num_experts={num_experts!r}): need an int >= 1."
            )
        self.std = 1.0 / num_experts**2

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """The noisy logits (a new tensor)."""
        return inputs + torch.randn_like(inputs) * self.std


class UniformNoiseGenerator:
    """``logits * U(1 - eps, 1 + eps)``.

    Args:
        eps: the jitter's half width (default ``1e-2``).

    Example:
        >>> jittered = UniformNoiseGenerator(0.1)(torch.ones(2, 3))
        >>> bool(((jittered >= 0.9) & (jittered <= 1.1)).all())
        True
    """

    def __init__(self, eps: float = 1e-2) -> None:
        if not 0 <= eps < 1:
            raise ValueError(f"UniformNoiseGenerator(eps={eps!r}): eps must be in [0, 1).")
        self.eps = eps

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        """The jittered logits (a new tensor)."""
        jitter = torch.empty_like(inputs).uniform_(1.0 - self.eps, 1.0 + self.eps)
        return inputs * jitter
