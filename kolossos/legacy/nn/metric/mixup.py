"""``MixupAccuracy``: the number of correct predictions on mixup batches, scored against each
sample's dominant target.

Mixup trains on ``lam * x_a + (1 - lam) * x_b`` with the loss
``lam * CE(out, targets_a) + (1 - lam) * CE(out, targets_b)``. The Colossal-AI ViT tutorial's
``AccuracyHook(accuracy_func=MixupAccuracy())`` does not define the class (its examples
repository scores against ``targets_a``, which is the dominant target when ``lam >= 0.5``).
Here the dominant target is ``targets_a`` where ``lam >= 0.5`` and ``targets_b`` elsewhere
(``lam`` may be a number or one value per sample).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["MixupAccuracy", "dominant_targets"]


def dominant_targets(targets: Any) -> torch.Tensor:
    """Class indices of each sample's dominant target.

    Args:
        targets: one of
            - a mapping with ``targets_a``, ``targets_b`` and ``lam`` (the examples' mixup
              label dict);
            - a sequence ``(targets_a, targets_b, lam)``;
            - soft labels: a float tensor of shape ``(batch, classes)`` (its argmax);
            - plain class indices (returned as they are).

    Raises:
        ValueError: a mapping or sequence of another shape.

    Example:
        >>> dominant_targets((torch.tensor([1, 2]), torch.tensor([0, 0]), 0.3)).tolist()
        [0, 0]
    """
    if isinstance(targets, Mapping):
        missing = [k for k in ("targets_a", "targets_b", "lam") if k not in targets]
        if missing:
            raise ValueError(
                f"MixupAccuracy got label keys {sorted(targets)}; a mixup label dict needs "
                "'targets_a', 'targets_b' and 'lam'."
            )
        return _pick(targets["targets_a"], targets["targets_b"], targets["lam"])
    if isinstance(targets, Sequence) and not isinstance(targets, (str, bytes)):
        if len(targets) != 3:
            raise ValueError(
                f"MixupAccuracy got a label sequence of length {len(targets)}; pass "
                "(targets_a, targets_b, lam), a mixup label dict, soft labels or class indices."
            )
        return _pick(*targets)
    tensor = torch.as_tensor(targets)
    if tensor.is_floating_point() and tensor.dim() >= 2:
        return torch.argmax(tensor, dim=-1)
    return tensor


def _pick(targets_a: Any, targets_b: Any, lam: Any) -> torch.Tensor:
    a = torch.as_tensor(targets_a)
    b = torch.as_tensor(targets_b).to(a.device)
    weight = torch.as_tensor(lam, device=a.device)
    return torch.where(weight >= 0.5, a, b)


class MixupAccuracy(nn.Module):
    """Counts correct predictions of mixup batches: ``metric(logits, targets)`` is a 0-dim
    integer tensor, the number of samples whose ``argmax(logits, -1)`` is their dominant target
    (see :func:`dominant_targets` for the label forms).

    ``AccuracyHook`` hands it the labels whole (``accepts_structured_targets``), so a
    ``(targets_a, targets_b, lam)`` tuple is not cut to its first element.

    Example:
        >>> logits = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
        >>> labels = {"targets_a": torch.tensor([0, 0]), "targets_b": torch.tensor([1, 1]),
        ...           "lam": 0.7}
        >>> MixupAccuracy()(logits, labels).item()
        1
    """

    accepts_structured_targets = True

    def forward(self, logits: torch.Tensor, targets: Any) -> torch.Tensor:
        """The number of samples predicted as their dominant target."""
        with torch.no_grad():
            preds = torch.argmax(logits, dim=-1)
            return torch.sum(dominant_targets(targets).to(preds.device) == preds)
