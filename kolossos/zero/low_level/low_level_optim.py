"""``LowLevelZeroOptimizer``: ZeRO stage 1 and 2 around any ``torch.optim.Optimizer``.

Each rank steps only its 1/N partition of every parameter group with fp32 master weights; the
gradients reach the partition owners by bucketed reduce-to-owner calls during backward
(:mod:`~kolossos.zero.low_level.reducer`), and the updated partitions are gathered back into the
model's weights after the step. The layout is documented in ``docs/zero.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
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
from kolossos.logging import get_dist_logger
from kolossos.nn.optimizer.flat_shards import check_flat_shard_safe
from kolossos.nn.optimizer.fused_step import fused_adam_step
from kolossos.zero.low_level.bucket import plan_buckets
from kolossos.zero.low_level.clip import check_finite_norm, clip_coefficient, global_norm
from kolossos.zero.low_level.comm import Communicator
from kolossos.zero.low_level.flat_buffers import flatten_params
from kolossos.zero.low_level.grad_buffers import FlatGradBuffers
from kolossos.zero.low_level.grad_store import GradStore, StoreMode
from kolossos.zero.low_level.offload import MasterWeights
from kolossos.zero.low_level.optim_state import PartitionedStateMixin
from kolossos.zero.low_level.options import ZeroOptions, check_norm_type
from kolossos.zero.low_level.overlap import ParamGatherer
from kolossos.zero.low_level.partition import FlatLayout, ParamSpan
from kolossos.zero.low_level.reducer import GradientReducer
from kolossos.zero.narrow_grads import DeferredClip

__all__ = ["LowLevelZeroOptimizer"]


class LowLevelZeroOptimizer(PartitionedStateMixin, OptimizerWrapper):
    """ZeRO-1 (``partition_grad=False``) or ZeRO-2 (``partition_grad=True``) data parallelism.

    Wraps an optimizer built over the model's parameters. Each parameter group becomes one flat
    buffer (the parameters turn into views of it), split evenly over the data-parallel ranks; the
    wrapped optimizer is re-pointed, in place (LR schedulers keep working), at this rank's fp32
    master partitions (with ``master_weights=False``: its slices of the working weights), one
    per group, keeping every group's hyper-parameters. ``state_dict()`` / ``load_state_dict()``
    speak torch's format with full per-parameter states (see
    :class:`~kolossos.zero.low_level.optim_state.PartitionedStateMixin`). fp16 parameters
    get a dynamic loss scale (overflow is agreed on by all ranks); bf16 and fp32 need none.

    Always back-propagate through :meth:`backward` (``booster.backward``): it scales the loss
    and drives the gradient reduction. Parameters with ``requires_grad=False`` are left alone.

    Args:
        optimizer: the optimizer over the model's (already device-placed) parameters.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scaler (:class:`kolossos.amp.DynamicGradScaler`).
        clip_grad_norm: clip to this global norm at every step (0: off).
        verbose: log the layout on rank 0.
        reduce_bucket_size: largest gradient bucket, in elements.
        communication_dtype: dtype of gradient reduction (default: the parameters').
        overlap_communication: reduce buckets while backward continues.
        partition_grad: ZeRO-2 (also shard gradients).
        cpu_offload: master weights, gradient partition and optimizer states on the CPU.
        dp_process_group: the data-parallel group (default: all ranks).
        forced_dtype: cast the parameters to this dtype first.
        moe_extra_dp_process_group: not supported (must be ``None``): no expert-parallel
            (MoE) parameters; every parameter is sharded over ``dp_process_group``.
        master_weights: keep fp32 master partitions (default). ``False``: no fp32 copy; the
            wrapped optimizer steps this rank's slice of the working weights (and keeps its
            states) in the working dtype, gradients are not cast to fp32.
        tp_process_group: not supported (must be ``None``); Colossal-AI 0.3.1-0.3.3 had it.
        norm_type: the norm of ``clip_grad_norm``.
        overlap_allgather: gather the updated partitions asynchronously after the step, bucket
            by bucket (``reduce_bucket_size``), each waited on by the forward pre-hook of the
            modules using it once :meth:`install_gather_hooks` has been called with the model
            (without it, ``step`` waits for them itself).

    Example:
        >>> model = torch.nn.Linear(8, 8).to(torch.bfloat16)
        >>> opt = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), partition_grad=True)
        >>> opt.backward(model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum())
        >>> opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    narrow_grads = True
    """bf16 gradient partitions go to kolossos' Adams as they are (kolossos.zero.narrow_grads)"""

    def __init__(
        self,
        optimizer: Optimizer,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        max_scale: float = 2**24,
        clip_grad_norm: float = 0.0,
        verbose: bool = False,
        reduce_bucket_size: int = 1024 * 1024,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: dist.ProcessGroup | None = None,
        forced_dtype: torch.dtype | None = None,
        moe_extra_dp_process_group: dist.ProcessGroup | None = None,
        master_weights: bool = True,
        *,
        tp_process_group: dist.ProcessGroup | None = None,
        norm_type: float = 2.0,
        overlap_allgather: bool = False,
    ) -> None:
        check_flat_shard_safe(optimizer, type(self).__name__)
        super().__init__(optimizer)
        self.loss_scale_policy = LossScalePolicy.of(locals())
        self.options = ZeroOptions(
            partition_grad=partition_grad,
            reduce_bucket_size=reduce_bucket_size,
            communication_dtype=communication_dtype,
            overlap_communication=overlap_communication,
            cpu_offload=cpu_offload,
            clip_grad_norm=clip_grad_norm,
            norm_type=norm_type,
            forced_dtype=forced_dtype,
            verbose=verbose,
            master_weights=master_weights,
        )
        if tp_process_group is not None:
            raise NotImplementedError(
                "tp_process_group is not supported by LowLevelZeroOptimizer yet; combine tensor "
                "parallelism with ZeRO through HybridParallelPlugin."
            )
        if moe_extra_dp_process_group is not None:
            raise NotImplementedError(
                "moe_extra_dp_process_group is not supported: LowLevelZeroOptimizer has no "
                "expert-parallel (MoE) parameters; leave it None (every parameter is then "
                "sharded over dp_process_group)."
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "LowLevelZeroOptimizer needs torch.distributed to be initialised; call "
                "kolossos.launch_from_torch() (or kolossos.launch) first."
            )
        self.comm = Communicator(dp_process_group)
        self._build_buffers()
        dtype = self.working_dtype
        self.scaler: DynamicGradScaler | None = None
        if dtype == torch.float16:
            self.scaler = DynamicGradScaler.from_policy(self.loss_scale_policy, verbose)
        self._build_reducer(communication_dtype or dtype)
        narrow = self.narrow_grads and self.options.master_weights
        self._clip = DeferredClip.for_update(self.optim, self.masters.params,
                                             dtype if narrow else torch.float32)  # fmt: skip
        self._no_sync = False
        self._backwards = 0  # backward passes since the last zero_grad
        self._prepared: tuple[list[torch.Tensor | None], bool] | None = None
        self._skipped = False
        self.gatherer: ParamGatherer | None = None
        if overlap_allgather:
            self.gatherer = ParamGatherer(self.comm, self.groups, self.layouts, self.flat_work,
                                          reduce_bucket_size)  # fmt: skip
        if verbose:
            self._log_layout()

    # ------------------------------------------------------------------ construction
    def _build_buffers(self) -> None:
        options, rank = self.options, self.comm.rank
        device = None
        self.groups: list[list[nn.Parameter]] = []
        self.layouts: list[FlatLayout] = []
        self.flat_work: list[torch.Tensor] = []
        existing = {p: dict(s) for p, s in self.optim.state.items()}
        for group in self.optim.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            for p in params:
                device = device or p.device
                if p.device != device:
                    raise ValueError(
                        f"parameters on {p.device} and {device}: move the model to one device "
                        "before building the ZeRO optimizer."
                    )
                if options.forced_dtype is not None:
                    p.data = p.data.to(options.forced_dtype)
            layout = FlatLayout.of_shapes([p.shape for p in params], self.comm.world_size)
            flat = flatten_params(params, layout, device or torch.device("cpu"))
            self.comm.broadcast(flat, 0)  # every rank starts from rank 0's weights
            self.groups.append(params)
            self.layouts.append(layout)
            self.flat_work.append(flat)
        dtypes = {flat.dtype for flat in self.flat_work if flat.numel()}
        if len(dtypes) > 1:
            raise TypeError(
                f"parameter groups hold different dtypes ({sorted(map(str, dtypes))}); give all "
                "parameters one dtype (the plugin's precision, or forced_dtype)."
            )
        self.working_dtype = dtypes.pop() if dtypes else torch.float32
        self.spans: dict[torch.Tensor, tuple[int, ParamSpan]] = {}
        for g, (params, layout) in enumerate(zip(self.groups, self.layouts, strict=True)):
            for p, span in zip(params, layout.spans, strict=True):
                self.spans[p] = (g, span)
        master_dtype = torch.float32 if options.master_weights else None
        self.masters = MasterWeights(
            self.flat_work, self.layouts, rank, options.cpu_offload, master_dtype
        )
        for group, master in zip(self.optim.param_groups, self.masters.params, strict=True):
            group["params"] = [master]
        self.optim.state.clear()
        if any(existing.values()):  # boosted after some steps: keep the states, re-sliced
            self.load_param_states(
                (g, i, existing[p])
                for g, params in enumerate(self.groups)
                for i, p in enumerate(params)
                if existing.get(p)
            )

    def _build_reducer(self, comm_dtype: torch.dtype) -> None:
        options = self.options
        stage2 = options.partition_grad
        device = self.flat_work[0].device if self.flat_work else torch.device("cpu")
        self.flat_grads: FlatGradBuffers | None = None
        if not stage2:
            self.flat_grads = FlatGradBuffers(self.layouts, self.working_dtype, device)
        mode = StoreMode.OFFLOAD if options.cpu_offload else StoreMode.SHARD
        self.store = GradStore(self.layouts, self.comm.rank, mode, self.working_dtype, device)
        buckets = plan_buckets(self.layouts, options.reduce_bucket_size)
        self.reducer = GradientReducer(
            self.groups,
            self.layouts,
            buckets,
            self.comm,
            self.store,
            self.flat_grads,
            comm_dtype,
            options.overlap_communication,
        )
        self.reducer.register_hooks()

    def _log_layout(self) -> None:
        stage = 2 if self.options.partition_grad else 1
        sizes = [layout.partition_numel for layout in self.layouts]
        get_dist_logger().info(
            f"ZeRO-{stage}: {len(self.layouts)} group(s), partition sizes {sizes} elements, "
            f"{len(self.reducer.buckets)} gradient buckets, working dtype {self.working_dtype}, "
            f"masters on {self.masters.device}",
            ranks=[0],
        )

    # ------------------------------------------------------------------ overlap_allgather
    def install_gather_hooks(self, model: nn.Module) -> None:
        """``overlap_allgather``: make ``model``'s modules wait, in forward pre-hooks, for the
        gathers of their own parameters (and its state dicts for all of them).

        Raises:
            ValueError: the optimizer was built without ``overlap_allgather=True``.
        """
        if self.gatherer is None:
            raise ValueError(
                "install_gather_hooks needs LowLevelZeroOptimizer(overlap_allgather=True); "
                "without it the parameters are gathered inside step()."
            )
        self.gatherer.install(model)

    def wait_param_gather(self) -> None:
        """Wait for the parameter gathers still in flight (``overlap_allgather``): call it
        before reading the weights outside a forward (the state dicts and ``step`` do)."""
        if self.gatherer is not None:
            self.gatherer.wait_all()

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`PartitionedStateMixin.state_dict` (pending gathers are waited for)."""
        self.wait_param_gather()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`PartitionedStateMixin.load_state_dict` (pending gathers are waited for)."""
        self.wait_param_gather()
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ introspection
    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The model parameters this optimizer manages (not the internal master partitions)."""
        for group in self.groups:
            yield from group

    def working_params(self) -> list[torch.Tensor]:
        """Same as :meth:`parameters`, as a list (the Booster maps names through it)."""
        return list(self.parameters())

    def master_params(self) -> list[nn.Parameter]:
        """This rank's master partitions, one per group (what the wrapped optimizer steps):
        fp32, or views of the working weights with ``master_weights=False``."""
        return list(self.masters.params)

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``step`` was skipped for an fp16 overflow."""
        return self._skipped

    def get_loss_scaler(self) -> DynamicGradScaler | None:
        """The fp16 loss scaler (``None`` for bf16/fp32 working weights)."""
        return self.scaler

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the flat buffers are built once; add every group before boosting."""
        raise NotImplementedError(
            "LowLevelZeroOptimizer cannot add a param group after construction (its flat "
            "buffers are fixed); add all groups to the optimizer before booster.boost."
        )

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication (ZeRO-1). ZeRO-2 keeps reducing every
        backward into its gradient partition, so accumulation stays correct and memory stays
        sharded, but no communication is saved."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss * loss_scale / N`` and reduce the gradients to their owners."""
        self._run_backward(lambda factor: (loss.float() * factor).backward(*args, **kwargs))

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with upstream gradient ``grad`` (scaled likewise)."""
        self._run_backward(lambda factor: torch.autograd.backward(tensor, grad * factor))

    def _run_backward(self, run: Callable[[float], None]) -> None:
        with self.backward_pass(sync=not self._no_sync):
            run(self.loss_scale / self.comm.world_size)  # the reduction then is a plain sum

    @contextlib.contextmanager
    def backward_pass(self, sync: bool) -> Iterator[None]:
        """One backward pass for the gradient reducer: every backward inside the context
        accumulates into this rank's gradients, which are reduced over the data-parallel group
        as they become ready (``sync=True``) or at the step (``sync=False``, ZeRO-1). The losses
        back-propagated inside must already be scaled by ``loss_scale / world_size``."""
        if self.flat_grads is not None:
            self.reducer.attach_grads()
        self._prepared = None
        self._clip.clear()  # a clip before this backward applied to gradients it replaces
        self.reducer.begin(sync=sync)
        try:
            yield
        except BaseException:
            self.reducer.abort()
            raise
        self.reducer.finish()
        self._backwards += 1

    def sync_grad(self) -> None:
        """Reduce now the gradients accumulated without communication (``no_sync`` passes);
        nothing to do after a synchronised backward (COLLECTIVE when something is pending)."""
        if self.reducer.local_unreduced:
            self.reducer.reduce_all()

    # ------------------------------------------------------------------ gradients
    def _prepare(self) -> tuple[list[torch.Tensor | None], bool]:
        """Gradient partitions next to the masters and in their dtype (fp32, or the working
        dtype without master weights; bf16 partitions stay bf16 for kolossos' Adams), unscaled;
        and the global overflow flag. Computed once per step (clipping and ``step`` share it)."""
        if self._prepared is not None:
            return self._prepared
        if self.reducer.local_unreduced:  # no_sync passes, then step without a synced backward
            self.reducer.reduce_all()
        grads: list[torch.Tensor | None] = []
        for g, master in enumerate(self.masters.params):
            part = self.store.partition(g)
            if part is not None and not self._clip.takes(part, master):
                part = part.to(device=master.device, dtype=master.dtype)
            grads.append(part)
        found_inf = False
        if self.scaler is not None:
            local = unscale_and_check_(grads, self.scaler.inv_scale)
            found_inf = all_reduce_overflow(local, self.comm.group)  # sync point
        self._prepared = (grads, found_inf)
        return self._prepared

    def _valid(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The gradient partitions without their padding."""
        return [
            g[: layout.valid_numel(self.comm.rank)]
            for g, layout in zip(grads, self.layouts, strict=True)
            if g is not None
        ]

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradient partitions so that the global ``norm_type``-norm (over all ranks,
        padding excluded) is at most ``max_norm``; returns the norm before clipping (``inf``
        when an fp16 overflow will skip the step)."""
        _check_clip(max_norm, "max_norm")
        norm_type = check_norm_type(norm_type)
        grads, found_inf = self._prepare()
        if found_inf:
            return torch.tensor(float("inf"))
        group = self.comm.group
        total = global_norm(self._valid(grads), norm_type, group, comm_device(group))
        check_finite_norm(total, norm_type, error_if_nonfinite)
        self._clip.scale(grads, clip_coefficient(max_norm, total))
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clamp every element of the gradient partitions into ``[-clip_value, clip_value]``."""
        _check_clip(clip_value, "clip_value")
        grads, found_inf = self._prepare()
        if not found_inf:
            self._clip.apply(grads)  # clamp the clipped values, as with fp32 gradients
            for g in grads:
                if g is not None:
                    g.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ step
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Update this rank's partitions and gather everyone's into the model's weights.

        Skipped (``None`` returned, gradients dropped, scale backed off) when any rank saw an
        fp16 overflow; a no-op when no backward ran since the last ``zero_grad``.
        """
        if args or kwargs:
            raise NotImplementedError("LowLevelZeroOptimizer.step() takes no closure.")
        if self._backwards == 0:
            return None
        self.wait_param_gather()  # this rank's partition is about to be overwritten
        grads, found_inf = self._prepare()
        self._skipped = found_inf
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.zero_grad()
            return None
        if self.options.clip_grad_norm > 0:
            self.clip_grad_by_norm(self.options.clip_grad_norm, self.options.norm_type)
        for master, grad in zip(self.masters.params, grads, strict=True):
            master.grad = grad
        with fused_adam_step(self.optim), self._clip.stepping(self.optim):
            out = self.optim.step()  # host shards of a plain Adam: torch's fused kernel
        for g, master in enumerate(self.masters.params):
            part, grad = self.store.partition(g), master.grad
            if part is None or grad is None or grad.data_ptr() != part.data_ptr():
                master.grad = None  # a converted copy; stored partitions stay until zero_grad
        self._prepared = None
        self.masters.write_back()
        if self.gatherer is not None:
            self.gatherer.launch()  # COLLECTIVE, async: waited on by the forward pre-hooks
            if not self.gatherer.hooked:
                self.gatherer.wait_all()
            return out
        for handle in [self.comm.gather_partitions(flat) for flat in self.flat_work]:
            handle.wait()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient, reduced or local (ZeRO-1's flat gradient buffer is freed; a
        later ``no_sync`` pass allocates it again)."""
        self.store.clear()
        if self.flat_grads is not None:
            self.reducer.forget_local()
        for master in self.masters.params:
            master.grad = None
        if self.flat_grads is None:
            for p in self.parameters():
                p.grad = None
        self.reducer.local_unreduced = False
        self._prepared = None
        self._clip.clear()
        self._backwards = 0
