"""``GeminiOptimizer``: steps the fp32 master shards of a :class:`GeminiDDP` model's chunks.

The wrapped optimizer is re-pointed, in place (LR schedulers keep working, every group keeps its
hyper-parameters), from the model's parameters to this rank's slices of them: views into the
chunks' fp32 ``master`` shards, with views into the gradient shards as gradients. A
``HybridAdam`` then steps host-resident shards on the CPU and device-resident ones on the device.

The gradient shards are fp32, except in bf16 training with one of kolossos' Adams (torch 2.10
or later): those widen each gradient inside the update (:mod:`kolossos.zero.narrow_grads`), so
the shards stay bf16, the dtype the reduction produced, and the model states peak at
(2 + 12)·Ψ/N bytes instead of (4 + 12)·Ψ/N, training unchanged. A chunk with NVMe-streamed
states keeps an fp32 shard (the streamed update reads fp32 gradients); the others stay bf16.

fp16 gets a dynamic loss scale (overflow agreed on by all ranks, the step skipped); clipping is by
the global norm over every rank's gradient shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.optim import Optimizer

from kolossos.amp import (
    DynamicGradScaler,
    LossScalePolicy,
    all_reduce_overflow,
    unscale_and_check_,
)
from kolossos.cluster.collectives import comm_device
from kolossos.interface import OptimizerWrapper
from kolossos.interface.optimizer import _check_clip
from kolossos.nn.optimizer import CPUAdam, HybridAdam
from kolossos.nn.optimizer.flat_shards import check_flat_shard_safe
from kolossos.nn.optimizer.fused_step import fused_adam_step
from kolossos.zero.gemini.chunk import Chunk
from kolossos.zero.gemini.colo_params import repoint_optimizer_params, tp_grad_norm, tp_group_of
from kolossos.zero.gemini.full_tensors import local_range
from kolossos.zero.gemini.gemini_ddp import GeminiDDP
from kolossos.zero.gemini.optim_placement import host_optim_chunks, move_optim_data
from kolossos.zero.gemini.optim_state import ShardedStateIO
from kolossos.zero.low_level.clip import check_finite_norm, clip_coefficient, global_norm
from kolossos.zero.low_level.options import check_norm_type
from kolossos.zero.narrow_grads import DeferredClip, allow_narrow_grads, takes_narrow_grads

__all__ = ["GeminiAdamOptimizer", "GeminiOptimizer"]

#: (chunk, begin, end, model parameter, master view) for every local slice
Slice = tuple[Chunk, int, int, nn.Parameter, nn.Parameter]


class GeminiOptimizer(ShardedStateIO, OptimizerWrapper):
    """ZeRO-3 optimizer over the chunks of a :class:`GeminiDDP` model.

    Always back-propagate through :meth:`backward` (``booster.backward``); ``loss.backward()``
    alone skips the loss scale.

    Args:
        optimizer: an optimizer built over ``module.parameters()`` (e.g. ``HybridAdam``), not
            stepped yet.
        module: the :class:`GeminiDDP` model.
        gpu_margin_mem_ratio: ``auto`` placement only: share of the spare device memory (measured
            in the warm-up iteration) into which the optimizer data of host chunks moves, chunk
            by chunk before the steps (from the first on, so that the states of those chunks
            are created on the device), to be stepped on the device from then on.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scaler (:class:`kolossos.amp.DynamicGradScaler`).
        max_norm: clip to this global norm at every step (0: off).
        norm_type: the norm of ``max_norm``.
        verbose: log loss-scale changes.

    Example:
        >>> model = GeminiDDP(torch.nn.Linear(8, 8), mixed_precision=torch.bfloat16)
        >>> opt = GeminiOptimizer(HybridAdam(model.parameters(), lr=1e-3), model)
        >>> opt.backward(model(torch.ones(2, 8)).float().sum()); opt.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        optimizer: Optimizer,
        module: GeminiDDP,
        *,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        verbose: bool = False,
    ) -> None:
        check_flat_shard_safe(optimizer, "Gemini")
        super().__init__(optimizer)
        self.loss_scale_policy = LossScalePolicy.of(locals())
        if not isinstance(module, GeminiDDP):
            raise TypeError(f"module must be a GeminiDDP model, got {type(module).__name__}.")
        module.policy.check_gpu_margin_mem_ratio(gpu_margin_mem_ratio)  # auto policy only
        self.gpu_margin_mem_ratio = float(gpu_margin_mem_ratio)
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm} must be >= 0 (0 disables clipping).")
        self.norm_type = check_norm_type(norm_type)
        self.max_norm = float(max_norm)
        self.module = module
        self.manager = module.chunk_manager
        self.scaler: DynamicGradScaler | None = None
        if module.dtype == torch.float16:
            self.scaler = DynamicGradScaler.from_policy(self.loss_scale_policy, verbose)
        repoint_optimizer_params(self.optim, module.module)  # ColoParameters -> their pieces
        self._names = {p: n for n, p in module.module.named_parameters()}
        self._group_names = [
            [self._names[p] for p in group["params"] if p in self._names]
            for group in self.optim.param_groups
        ]
        self.slices: list[Slice] = self._repoint()
        _rebuild_nvme_offloader(self.optim)
        self._clip = DeferredClip(self._narrow_grad_shards(module.dtype))
        self._prepared: bool | None = None  # found_inf of the prepared gradients
        self._skipped = False

    def _narrow_grad_shards(self, dtype: torch.dtype) -> bool:
        """Keep in bf16 the gradient shards of the chunks whose views the optimizer can all
        step with bf16 gradients (module doc); return whether any view can."""
        takes = {id(v): takes_narrow_grads(self.optim, v, dtype) for *_, v in self.slices}
        if not any(takes.values()):
            return False
        wide = {c.chunk_id for c, *_, v in self.slices if not takes[id(v)]}
        allow_narrow_grads([v for c, *_, v in self.slices if c.chunk_id not in wide])
        for chunk in self.manager:
            if chunk.chunk_id not in wide:
                chunk.grad_dtype = dtype
        return True

    def _repoint(self) -> list[Slice]:
        if any(self.optim.state.values()):
            raise ValueError(
                "the optimizer already has states (it was stepped); build GeminiOptimizer "
                "before the first step, or load states with load_full_states afterwards."
            )
        slices: list[Slice] = []
        for group in self.optim.param_groups:
            views = []
            for p in group["params"]:
                if not self.manager.manages(p):
                    raise ValueError(
                        f"an optimizer parameter of shape {tuple(p.shape)} is not in the "
                        "GeminiDDP model; build the optimizer over model.parameters()."
                    )
                chunk, info = self.manager.locate(p)
                span = local_range(chunk, info)
                if span is None:
                    continue
                assert chunk.master is not None
                view = nn.Parameter(chunk.master[span[0] : span[1]], requires_grad=True)
                slices.append((chunk, span[0], span[1], p, view))
                views.append(view)
            group["params"] = views
        return slices

    # ------------------------------------------------------------------ introspection
    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 otherwise)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def get_loss_scaler(self) -> DynamicGradScaler | None:
        """The fp16 loss scaler (``None`` for bf16/fp32)."""
        return self.scaler

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step`` was skipped for an fp16 overflow."""
        return self._skipped

    def parameters(self) -> Iterator[nn.Parameter]:
        """The model parameters this optimizer updates (not the internal master views)."""
        seen: set[int] = set()
        for _, _, _, p, _ in self.slices:
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    def param_names(self) -> list[list[str]]:
        """The state-dict name of every parameter, per group, as the optimizer was given them
        (each rank's groups then list only the parameters it holds a slice of)."""
        return [list(names) for names in self._group_names]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the chunk layout is fixed at wrap time."""
        raise NotImplementedError(
            "GeminiOptimizer cannot add a param group after construction; put every group in "
            "the optimizer before wrapping."
        )

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss * loss_scale`` and finish the chunks' reduction (COLLECTIVE)."""
        self._prepared = None
        self._apply_deferred_clip()  # accumulate onto clipped gradients, as with fp32 ones
        (loss.float() * self.loss_scale).backward(*args, **kwargs)
        self.module.finish_backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with upstream ``grad`` (scaled likewise)."""
        self._prepared = None
        self._apply_deferred_clip()
        torch.autograd.backward(tensor, grad * self.loss_scale)
        self.module.finish_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation (see :meth:`GeminiDDP.no_sync`: correct with or without it)."""
        with self.module.no_sync():
            yield

    def sync_grad(self) -> None:
        """Finish the reduction of the chunks' gradients over the data-parallel group (nothing
        is pending after ``backward``, which finishes it; COLLECTIVE otherwise)."""
        self.module.finish_backward()

    # ------------------------------------------------------------------ gradients
    def _grad_shards(self) -> list[torch.Tensor]:
        return [c.grad_shard for c in self.manager if c.grad_shard is not None]

    def _prepare(self) -> bool:
        """Unscale the gradient shards once per step; True when some rank overflowed."""
        self.module.finish_backward()
        if self._prepared is None:
            found_inf = False
            if self.scaler is not None:
                local = unscale_and_check_(self._grad_shards(), self.scaler.inv_scale)
                found_inf = all_reduce_overflow(local, self.module.process_group)  # sync point
                tp_group = tp_group_of(self.module.module)
                if tp_group is not None:  # the tp ranks of a dp group skip the step together
                    found_inf = all_reduce_overflow(found_inf, tp_group)  # sync point
            self._prepared = found_inf
        return self._prepared

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradient shards so the global ``norm_type``-norm is at most ``max_norm``;
        returns the norm before clipping (``inf`` when an fp16 overflow skips the step).
        COLLECTIVE."""
        _check_clip(max_norm, "max_norm")
        norm_type = check_norm_type(norm_type)
        if self._prepare():
            return torch.tensor(float("inf"))
        group = self.module.process_group
        device = comm_device(group)
        # tensor-parallel ColoParameters: each tp piece counted once, replicated ones once
        total = tp_grad_norm(self.module.module, self.manager, norm_type, device)
        if total is None:
            total = global_norm(self._grad_shards(), norm_type, group, device)
        check_finite_norm(total, norm_type, error_if_nonfinite)
        self._clip.scale(self._grad_shards(), clip_coefficient(max_norm, total))
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clamp every gradient element into ``[-clip_value, clip_value]``."""
        _check_clip(clip_value, "clip_value")
        if not self._prepare():
            self._apply_deferred_clip()  # clamp the clipped values, as with fp32 gradients
            for g in self._grad_shards():
                g.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ step
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Update the master shards, refresh the working copies and free the gradient shards
        (COLLECTIVE), as Colossal-AI's and DeepSpeed's ZeRO optimizers do: gradients live from
        backward to step, so a backward after ``step`` starts a new accumulation whether or not
        ``zero_grad`` ran. Skipped (``None``, gradients dropped, scale backed off) on an fp16
        overflow of any rank."""
        if args or kwargs:
            raise NotImplementedError("GeminiOptimizer.step() takes no closure.")
        self.module.finish_backward()
        if not self._grad_shards():  # no backward since the last step or zero_grad
            return None
        found_inf = self._prepare()
        self._skipped = found_inf
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.zero_grad()
            return None
        if self.max_norm > 0:
            self.clip_grad_by_norm(self.max_norm, self.norm_type)
        if self.gpu_margin_mem_ratio > 0:  # before the states are created (optim_placement)
            self._place_optim_data()
        for chunk, begin, end, p, view in self.slices:
            # a parameter without any gradient in this accumulation is skipped, as torch does
            got = chunk.grad_shard is not None and self.manager.locate(p)[1].has_grad
            view.grad = chunk.grad_shard[begin:end] if got else None  # type: ignore[index]
        with fused_adam_step(self.optim), self._clip.stepping(self.optim):
            out = self.optim.step()  # host shards of a plain Adam: torch's fused kernel
        for *_, view in self.slices:
            view.grad = None
        for chunk in self.manager:  # gradient shards live from backward to step only
            chunk.drop_grads()
            chunk.refresh_from_master()
        self._prepared = None
        return out

    def _apply_deferred_clip(self) -> None:
        """Apply a deferred clipping factor to the bf16 gradient shards now, widening them."""
        if self._clip.factor is None:
            return
        for chunk in self.manager:
            if chunk.grad_shard is not None:
                chunk.grad_shard = self._clip.widen(chunk.grad_shard)
        self._clip.clear()

    def _place_optim_data(self) -> None:
        """Move the optimizer data of the chunks the policy grants to the device (auto)."""
        by_chunk: dict[int, list[tuple[int, int, nn.Parameter]]] = {}
        for chunk, begin, end, _, view in self.slices:
            by_chunk.setdefault(chunk.chunk_id, []).append((begin, end, view))
        views = {cid: [v for *_, v in items] for cid, items in by_chunk.items()}
        offer = host_optim_chunks(self.optim, self.manager.chunks, views)
        granted = self.module.policy.place_optim_states(offer, self.gpu_margin_mem_ratio)
        for chunk in granted:
            move_optim_data(
                self.optim, chunk, by_chunk.get(chunk.chunk_id, []), self.module.compute_device
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient shard (accumulation starts over). With ``set_to_none=False``
        the shards are zeroed instead, and parameters that had a gradient keep being stepped
        (with a zero gradient), as torch does."""
        self.module.finish_backward()
        for chunk in self.manager:
            if set_to_none or chunk.grad_shard is None:
                chunk.drop_grads()
            else:
                chunk.grad_shard.zero_()
        for *_, view in self.slices:
            view.grad = None
        self._prepared = None
        self._clip.clear()


def _rebuild_nvme_offloader(optim: Optimizer) -> None:
    """CPUAdam / HybridAdam with ``nvme_offload_fraction > 0`` chose the parameters whose states
    go to disk when built, over the model's parameters; after re-pointing the groups at the
    master views it must choose again among those views."""
    if isinstance(optim, CPUAdam):
        optim.rebuild_offloader()


_ADAM_KEYS = ("lr", "bias_correction", "betas", "eps", "weight_decay", "adamw_mode",
              "nvme_offload_fraction", "nvme_offload_dir")  # fmt: skip


def GeminiAdamOptimizer(module: GeminiDDP, **defaults: Any) -> GeminiOptimizer:
    """``GeminiOptimizer(HybridAdam(module.parameters(), ...), module, ...)`` in one call, as
    Colossal-AI's ``GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5)``: HybridAdam's
    keywords go to HybridAdam, the others to :class:`GeminiOptimizer`."""
    adam = {k: defaults.pop(k) for k in list(defaults) if k in _ADAM_KEYS}
    return GeminiOptimizer(HybridAdam(module.parameters(), **adam), module, **defaults)
