"""Routers: which experts each token goes to, and which (token, expert) pairs fit.

A router takes the gate's logits ``[S, E]`` (``S`` tokens of this rank, ``E`` experts) and
returns a :class:`Routing`:

1. *Noise* (training only): ``noisy_func(logits)`` (:mod:`kolossos.moe.noise`).
2. *Top-k*: each token picks the ``k`` experts of largest logit. Ties go to the lower expert
   index (a stable sort), so the same input routes the same way on every machine and at every
   expert-parallel size (routing only ever sees this rank's tokens).
3. *Capacity*: each expert takes at most ``C = max(min_capacity, even(floor(k * cf * S / E)))``
   tokens, with ``cf = capacity_factor_train`` or ``capacity_factor_eval``. Slots are handed
   out first to every token's first choice, in token order, then to the second choices, and so
   on (``select_policy="random"``: tokens in a random order). A pair beyond ``C`` is *dropped*:
   its combine weight is 0, so the token passes only through the residual path. A capacity
   factor of ``None``, or ``drop_tks=False`` in evaluation, drops nothing (no-drop mode).
4. *Combine weights*: the softmax probability of the chosen expert (not renormalised over the
   ``k`` choices, as in Colossal-AI).
5. *Losses*: the load-balancing loss ``E / k * sum_e mean_s(p[s, e]) * f_e`` (``f_e``: the
   fraction of the ``k * S`` choices that picked ``e``, before dropping; Switch Transformer eq. 4
   for ``k = 1``, Colossal-AI's top-2 normalisation for ``k = 2``) and the router z-loss
   ``mean_s(logsumexp(logits[s])**2)`` (ST-MoE), on the logits before noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MoeRouter", "Routing", "Top1Router", "Top2Router", "TopKRouter"]


@dataclass(frozen=True)
class Routing:
    """The routing of one call: per token ``s`` and choice ``j < k``."""

    expert_index: torch.Tensor
    """``[S, k]`` int64: the chosen experts, best first."""
    combine_weight: torch.Tensor
    """``[S, k]`` float: the weight of each choice's output (0 where dropped; differentiable)."""
    kept: torch.Tensor
    """``[S, k]`` bool: whether the pair fit in the expert's capacity."""
    capacity: int | None
    """Tokens per expert (``None``: unlimited)."""
    aux_loss: torch.Tensor
    """The load-balancing loss (a 0-dim tensor)."""
    z_loss: torch.Tensor
    """The router z-loss (a 0-dim tensor)."""


def _positive_or_none(value: float | None, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not value > 0):
        raise ValueError(f"{name}={value!r} must be > 0, or None to drop no token.")


class MoeRouter(nn.Module):
    """Top-``k_value`` routing with a capacity (see the module docstring for the rules).

    Args:
        k_value: experts per token.
        capacity_factor_train: capacity factor in training (``None``: no dropping).
        capacity_factor_eval: capacity factor in evaluation (``None``: no dropping).
        min_capacity: the least capacity of an expert.
        noisy_func: applied to the logits in training (e.g. ``NormalNoiseGenerator(E)``).
        drop_tks: ``False``: evaluation drops no token.
        select_policy: ``"first"`` (token order) or ``"random"`` (training: random order).
    """

    def __init__(
        self,
        k_value: int,
        capacity_factor_train: float | None,
        capacity_factor_eval: float | None,
        min_capacity: int,
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
        select_policy: str = "first",
    ) -> None:
        super().__init__()
        if isinstance(k_value, bool) or not isinstance(k_value, int) or k_value < 1:
            raise ValueError(f"router k_value={k_value!r} must be an int >= 1.")
        _positive_or_none(capacity_factor_train, "capacity_factor_train")
        _positive_or_none(capacity_factor_eval, "capacity_factor_eval")
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise ValueError(f"min_capacity={min_capacity!r} must be an int >= 0.")
        if noisy_func is not None and not callable(noisy_func):
            raise TypeError(f"noisy_func={noisy_func!r} must be callable (logits -> logits).")
        if select_policy not in ("first", "random"):
            raise ValueError(f"select_policy={select_policy!r} must be 'first' or 'random'.")
        self.k_value = k_value
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.min_capacity = min_capacity
        self.noisy_func = noisy_func
        self.drop_tks = drop_tks
        self.select_policy = select_policy

    def get_capacity(self, num_tokens: int, num_experts: int) -> int | None:
        """Tokens per expert for ``num_tokens`` tokens, or ``None`` (no dropping).

        Example:
            >>> Top2Router(capacity_factor_train=1.2).get_capacity(16, 4)  # 2*1.2*16/4 = 9.6
            10
        """
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        if factor is None or (not self.training and not self.drop_tks):
            return None
        capacity = math.floor(self.k_value * factor * num_tokens / num_experts)
        capacity += capacity % 2  # even, as Colossal-AI
        return max(capacity, self.min_capacity)

    def _slots(self, choice: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``[S, k]``: each pair's slot in its expert's queue (choice-major, then token order)."""
        tokens, k = choice.shape
        order = torch.arange(tokens, device=choice.device)
        if self.select_policy == "random" and self.training:
            order = torch.randperm(tokens, device=choice.device)
        onehot = F.one_hot(choice[order].t().reshape(-1), num_experts)  # [(j, s'), E]
        slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1).reshape(k, tokens).t()
        out = torch.empty_like(slot)
        out[order] = slot
        return out

    def forward(self, inputs: torch.Tensor) -> Routing:
        """Route ``inputs``, the gate logits ``[S, E]`` (computed in fp32).

        Raises:
            ValueError: not 2-D, or fewer experts than ``k_value``.
        """
        if inputs.dim() != 2 or inputs.shape[1] < self.k_value:
            raise ValueError(
                f"router input of shape {tuple(inputs.shape)} must be [tokens, experts] with "
                f"at least k_value={self.k_value} experts."
            )
        raw = inputs.float()
        logits = self.noisy_func(raw) if self.noisy_func is not None and self.training else raw
        tokens, num_experts = logits.shape
        probs = F.softmax(logits, dim=-1)
        # deterministic: a stable sort breaks ties towards the lower expert index
        choice = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices
        choice = choice[:, : self.k_value]
        capacity = self.get_capacity(tokens, num_experts)
        if capacity is None:
            kept = torch.ones_like(choice, dtype=torch.bool)
        else:
            kept = self._slots(choice, num_experts) < capacity
        weight = probs.gather(1, choice) * kept
        picked = F.one_hot(choice, num_experts).sum(1).float()  # [S, E]: choices per expert
        if tokens:
            aux = num_experts / self.k_value * (probs.mean(0) * picked.mean(0)).sum()
            z_loss = torch.logsumexp(raw, dim=-1).pow(2).mean()
        else:
            aux = z_loss = probs.sum() * 0.0
        return Routing(choice, weight, kept, capacity, aux, z_loss)


class Top1Router(MoeRouter):
    """Switch Transformer routing: one expert per token.

    Example:
        >>> router = Top1Router(capacity_factor_train=1.0, min_capacity=1)
        >>> r = router(torch.tensor([[2.0, 1.0], [3.0, 0.0], [0.0, 1.0]]))
        >>> r.expert_index.flatten().tolist(), r.kept.flatten().tolist(), r.capacity
        ([0, 0, 1], [True, True, True], 2)
    """

    def __init__(
        self,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        select_policy: str = "first",
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
    ) -> None:
        super().__init__(1, capacity_factor_train, capacity_factor_eval, min_capacity,
                         noisy_func, drop_tks, select_policy)  # fmt: skip


class Top2Router(MoeRouter):
    """GShard / V-MoE routing: two experts per token.

    Example:
        >>> Top2Router(capacity_factor_train=1.2).k_value
        2
    """

    def __init__(
        self,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
    ) -> None:
        super().__init__(2, capacity_factor_train, capacity_factor_eval, min_capacity,
                         noisy_func, drop_tks)  # fmt: skip


class TopKRouter(MoeRouter):
    """Tokens choose their ``num_selected_experts`` best experts.

    Example:
        >>> TopKRouter(3).k_value
        3
    """

    def __init__(
        self,
        num_selected_experts: int,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
    ) -> None:
        super().__init__(num_selected_experts, capacity_factor_train, capacity_factor_eval,
                         min_capacity, noisy_func, drop_tks)  # fmt: skip
