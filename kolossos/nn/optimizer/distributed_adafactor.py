"""DistributedAdaFactor: Adafactor (Shazeer & Stern, 2018) over ZeRO and tensor-parallel shards,
with the factored statistics and RMS values of the full parameters (Colossal-AI's
``DistributedAdaFactor``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kolossos.nn.optimizer._adam_base import ParamsT
from kolossos.nn.optimizer._common import closure_loss, widened
from kolossos.nn.optimizer._distributed import DistributedLayout, ShardInfo
from kolossos.nn.optimizer._factored import FactoredView

__all__ = ["DistributedAdaFactor"]


class DistributedAdaFactor(torch.optim.Optimizer):
    r"""Adafactor as Hugging Face's ``transformers.optimization.Adafactor`` computes it, on
    whole parameters or on ZeRO / tensor-parallel shards of them (same numbers either way).

    Per parameter ``x`` (``R`` = root mean square over the *full* parameter), step ``t``:
    ``ρ = min(10⁻²` (``10⁻⁶ t`` with ``warmup_init``) ``, 1/√t)`` if ``relative_step`` else
    ``lr``; ``α = max(ε₂, R(x)) ρ`` if ``scale_parameter`` else ``ρ``; ``β₂ = 1 - t^{decay}``;
    ``u = g² + ε₁``. A parameter of two or more dimensions keeps row and column means of ``u``
    (factored second moment ``V ≈ r c / mean(r)``); others keep ``u`` itself. Then
    ``U = g / √V``, ``U /= max(1, R(U)/clip_threshold)``, ``U *= α``, optional first moment
    ``m = β₁ m + (1-β₁) U``, ``x -= α λ x`` and ``x -= U`` (or ``m``).

    Row/column statistics, their means and both RMS values are summed over the shards of the
    full parameter (the layout contract is in :mod:`kolossos.nn.optimizer._distributed`), so
    every rank keeps the factored statistics of its tensor-parallel shard whole (they are
    ``O(rows + columns)``; ZeRO does not split them).

    Args:
        params: parameters (ZeRO: their flat shards) or parameter-group dicts.
        lr: external learning rate; only with ``relative_step=False``.
        eps: ``(ε₁, ε₂)``: added to ``g²``; lower bound of the parameter scale.
        clip_threshold: threshold of the update's RMS.
        decay_rate: exponent of the second-moment decay ``β₂ = 1 - t^{decay_rate}``.
        beta1: first-moment decay; ``None``: no first moment.
        weight_decay: ``λ``, scaled by ``α``.
        scale_parameter: scale the step by the parameter's RMS.
        relative_step: time-dependent step size ``ρ`` instead of ``lr``.
        warmup_init: warm-up ``ρ = 10⁻⁶ t`` (needs ``relative_step``).

    Raises:
        ValueError: ``lr`` with ``relative_step=True``, no ``lr`` without it, or
            ``warmup_init`` without ``relative_step``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = DistributedAdaFactor(model.parameters())
        >>> # opt.setup_distributed(tp_group, dp_group, shard_to_working_param, use_zero=True)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
    ) -> None:
        if lr is not None and relative_step:
            raise ValueError(
                f"DistributedAdaFactor(lr={lr}, relative_step=True): the relative step replaces "
                "lr; pass relative_step=False to use lr, or drop lr."
            )
        if lr is None and not relative_step:
            raise ValueError("DistributedAdaFactor(relative_step=False) needs lr=...")
        if warmup_init and not relative_step:
            raise ValueError("DistributedAdaFactor(warmup_init=True) needs relative_step=True.")
        defaults = dict(
            lr=lr,
            eps=tuple(eps),
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
        )
        super().__init__(params, defaults)
        self.layout = DistributedLayout()

    def setup_distributed(
        self,
        tp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        shard_to_working_param: Mapping[int, Tensor] | None = None,
        padding_map: Mapping[int, int] | None = None,
        use_zero: bool = True,
    ) -> None:
        """Tell the optimizer how its parameters are sharded (as ``DistributedLamb``'s, whose
        ``is_zero`` is called ``use_zero`` here, defaulting to ``True`` as upstream: ZeRO is on
        when ``dp_group`` has more than one rank).

        Raises:
            NotImplementedError: a tensor-parallel shard with vocabulary padding.
            ValueError: an inconsistent layout (see ``DistributedLayout.setup``).
        """
        self.layout.setup(
            self.param_groups, tp_group, dp_group, shard_to_working_param, padding_map, use_zero
        )
        for info in self.layout.infos.values():
            if info.tp is not None and info.tp.padded and len(info.shape) >= 2:
                raise NotImplementedError(
                    f"DistributedAdaFactor: a tensor-parallel parameter padded by "
                    f"{info.tp.padded} rows (padding=) would bias the factored statistics; "
                    "build the layer without padding."
                )

    @staticmethod
    def _rel_lr(group: dict[str, Any], t: int, rms: Tensor) -> Tensor:
        step_size = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * t if group["warmup_init"] else 1e-2
            step_size = min(min_step, 1.0 / math.sqrt(t))
        if group["scale_parameter"]:
            return rms.clamp(min=group["eps"][1]) * step_size
        return torch.full_like(rms, step_size)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (COLLECTIVE once set up: every rank of the groups
        steps, with gradients for the same parameters); returns ``closure()``'s loss."""
        loss = closure_loss(closure)
        params = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return loss
        if any(p.grad.is_sparse for p, _ in params):
            raise RuntimeError("DistributedAdaFactor does not support sparse gradients")
        infos = [self.layout.info(p) for p, _ in params]
        # R(x) of every parameter at once: one sum per group of ranks
        dtype = functools.reduce(torch.promote_types, (widened(p.dtype) for p, _ in params))
        sq = torch.stack([p.to(widened(p.dtype)).pow(2).sum().to(dtype) for p, _ in params])
        sq = self.layout.sum_over_shards(sq.unsqueeze(1), infos)[:, 0]
        for (p, group), info, s in zip(params, infos, sq, strict=True):
            self._update(p, group, info, (s / info.full_numel).sqrt())
        return loss

    def _update(self, p: Tensor, group: dict[str, Any], info: ShardInfo, rms: Tensor) -> None:
        assert p.grad is not None
        dtype = widened(p.dtype)
        x, g = p.to(dtype), p.grad.to(dtype)
        state = self.state[p]
        factored = len(info.shape) >= 2
        view = FactoredView(info, self.layout) if factored else None
        if not state:
            state["step"] = 0
            if group["beta1"] is not None:
                state["exp_avg"] = torch.zeros_like(g)
            if view is not None:
                state["exp_avg_sq_row"] = torch.zeros(view.row_shape, dtype=dtype, device=g.device)
                state["exp_avg_sq_col"] = torch.zeros(view.col_shape, dtype=dtype, device=g.device)
            else:
                state["exp_avg_sq"] = torch.zeros_like(g)
        state["step"] += 1
        state["RMS"] = rms.to(device=p.device, dtype=dtype)
        lr = self._rel_lr(group, state["step"], state["RMS"])
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        if view is not None:
            update = view.scaled_gradient(g, state, beta2t, group["eps"][0])
        else:
            v = state["exp_avg_sq"]
            v.mul_(beta2t).add_(g * g + group["eps"][0], alpha=1.0 - beta2t)
            update = v.rsqrt().mul_(g)
        u_sq = update.pow(2).sum().reshape(1, 1)
        u_rms = (self.layout.sum_over_shards(u_sq, [info])[0, 0] / info.full_numel).sqrt()
        update.div_((u_rms.to(update.device) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if group["beta1"] is not None:
            m = state["exp_avg"]
            m.mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
            update = m
        if group["weight_decay"] != 0:
            x.add_(x * (-group["weight_decay"] * lr))
        x.add_(-update)
        if x is not p:
            p.copy_(x)
