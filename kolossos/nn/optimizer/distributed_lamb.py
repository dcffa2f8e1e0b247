"""DistributedLamb: :class:`~kolossos.nn.optimizer.Lamb` over ZeRO and tensor-parallel shards,
with the trust ratio of the full parameter (Colossal-AI's ``DistributedLamb``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kolossos.nn.optimizer._adam_base import ParamsT
from kolossos.nn.optimizer._common import closure_loss
from kolossos.nn.optimizer._distributed import DistributedLayout, ShardInfo
from kolossos.nn.optimizer.lamb import Lamb, trust_ratio

__all__ = ["DistributedLamb"]


class DistributedLamb(Lamb):
    r"""LAMB whose trust ratio ``φ(‖x‖)/‖r‖`` uses the norms of the *full* parameter and update
    when each rank steps a shard of them, so the sharded run equals :class:`Lamb` on one process.

    Without :meth:`setup_distributed` it is :class:`Lamb` (``adam=False``). After it, the squared
    norms of all parameters are summed over the data-parallel group (ZeRO shards) and over each
    split parameter's tensor-parallel group: one all-reduce of ``2 × parameters`` numbers per
    group per step. The layout contract is in :mod:`kolossos.nn.optimizer._distributed`.

    Args:
        params: parameters (ZeRO: their flat shards) or parameter-group dicts.
        lr: learning rate.
        betas: decay rates ``(β1, β2)``.
        eps: added to the denominator.
        weight_decay: decoupled weight decay inside the trust-scaled step.
        bias_correction: divide the moments by ``1 - β^t``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = DistributedLamb(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> # opt.setup_distributed(tp_group, dp_group, shard_to_working_param, is_zero=True)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0,
        bias_correction: bool = True,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction=bias_correction)
        self.layout = DistributedLayout()

    @property
    def tp_size(self) -> int:
        """Ranks of the tensor-parallel group (1 before :meth:`setup_distributed`)."""
        return self.layout.tp_size

    @property
    def dp_size(self) -> int:
        """Ranks of the data-parallel group (1 before :meth:`setup_distributed`)."""
        return self.layout.dp_size

    @property
    def is_zero(self) -> bool:
        """Whether the parameters are ZeRO shards over a group of more than one rank."""
        return self.layout.zero

    def setup_distributed(
        self,
        tp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        shard_to_working_param: Mapping[int, Tensor] | None = None,
        padding_map: Mapping[int, int] | None = None,
        is_zero: bool = False,
    ) -> None:
        """Tell the optimizer how its parameters are sharded.

        Args:
            tp_group: the tensor-parallel group (parameters marked with a ``TPShardSpec`` are
                split over it; each parameter's own spec group is used, and must match).
            dp_group: the data-parallel (ZeRO) group.
            shard_to_working_param: ZeRO: ``id(flat shard)`` -> the working parameter.
            padding_map: ZeRO: ``id(shard or working param)`` -> padding elements, checked
                against the shard sizes.
            is_zero: the parameters are ZeRO flat shards over ``dp_group``.

        Raises:
            ValueError: an inconsistent layout (see ``DistributedLayout.setup``).
        """
        self.layout.setup(
            self.param_groups, tp_group, dp_group, shard_to_working_param, padding_map, is_zero
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (COLLECTIVE once set up: every rank of the groups
        steps, with gradients for the same parameters); returns ``closure()``'s loss."""
        loss = closure_loss(closure)
        items: list[tuple[Tensor, Tensor, Tensor, float]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DistributedLamb does not support sparse gradients")
                x, r = self._direction(p, group)
                items.append((p, x, r, group["lr"]))
        if not items:
            return loss
        dtype = functools.reduce(torch.promote_types, (x.dtype for _, x, _, _ in items))
        sums = torch.stack(
            [torch.stack([x.pow(2).sum(), r.pow(2).sum()]).to(dtype) for _, x, r, _ in items]
        )
        infos: list[ShardInfo] = [self.layout.info(p) for p, _, _, _ in items]
        norms = self.layout.sum_over_shards(sums, infos).sqrt()
        for (p, x, r, lr), (w_norm, r_norm) in zip(items, norms, strict=True):
            trust = trust_ratio(w_norm, r_norm).to(device=x.device, dtype=x.dtype)
            self._apply(p, x, r, trust * lr)
        return loss
