"""``GeminiDDP``: ZeRO-3 over chunks — each rank stores 1/N of every chunk of parameters.

Wrapping packs the parameters into chunks (:mod:`~kolossos.zero.gemini.chunk`), keeps this
rank's fp32 slice of each chunk as the master copy, and installs the hooks of
:mod:`~kolossos.zero.gemini.gemini_hooks` that gather a chunk right before its first use in
forward and in backward, release it after use, and reduce-scatter its gradients into fp32
gradient shards. Buffers stay replicated (broadcast from the group's first rank at wrap; not
re-synchronised afterwards, so running statistics such as BatchNorm's evolve per rank).

A parameter is gathered by the forward hooks of the modules that register it directly, so it
must be used inside the forward of such a module (as every ``nn.Linear``, ``nn.Embedding``, HF
``Conv1D`` or tied ``lm_head`` is); reading another module's weight from outside that module's
forward sees an empty placeholder.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.accelerator import get_accelerator
from kolossos.amp import cast_floating
from kolossos.interface import ModelWrapper
from kolossos.lazy import is_lazy, lazy_named_tensors
from kolossos.zero.gemini.chunk import (
    ChunkManager,
    find_chunk_configuration,
    tied_params,
    unique_params,
)
from kolossos.zero.gemini.colo_params import prepare_dtensor_params
from kolossos.zero.gemini.full_tensors import FullTensorIO
from kolossos.zero.gemini.gemini_hooks import GeminiHooks
from kolossos.zero.gemini.lazy_chunks import fill_chunks_lazily
from kolossos.zero.gemini.placement.factory import create_placement_policy
from kolossos.zero.gemini.placement.static import StaticPlacementPolicy
from kolossos.zero.gemini.saved_payloads import payload_saving_hooks

__all__ = ["GeminiDDP"]

_logger = logging.getLogger(__name__)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pick(name: str, value: Any, alias: str, alias_value: Any, default: Any) -> Any:
    if alias_value is None:
        return value
    if value != default:
        raise ValueError(f"pass either {name}={value!r} or {alias}={alias_value!r}, not both.")
    return alias_value


class GeminiDDP(ModelWrapper):
    """Chunk-based ZeRO-3 data parallelism with Gemini's placement of chunks.

    Args:
        module: the model (its parameters are taken over: each becomes a view into a gathered
            chunk while in use and an empty placeholder otherwise).
        chunk_config_dict: ``{"chunk_size": elements}`` (e.g. the entry ``config[N]`` of
            :func:`~kolossos.zero.gemini.chunk.search_chunk_configuration`'s result); ``None``
            searches.
        chunk_init_device: where chunk shards start (the compute device or ``"cpu"``); the
            placement policy moves them from there. ``None``: the compute device.
        placement_policy: ``"static"``, ``"auto"`` or the aliases ``"cuda"``, ``"cpu"``,
            ``"const"`` (see :mod:`kolossos.zero.gemini.placement`).
        shard_param_frac, offload_optim_frac, offload_param_frac: static policy fractions.
        warmup_non_model_data_ratio, steady_cuda_cap_ratio, memstats, device_memory_budget:
            options of the auto policy.
        search_range_m, hidden_dim, min_chunk_size_m: chunk-size search (Mi-elements).
        mixed_precision: working dtype (fp16, bf16 or fp32); masters are always fp32.
        process_group: the data-parallel group (default: all ranks).
        pin_memory: pin host-resident chunk shards when the compute device is an accelerator.
        force_outputs_fp32: cast floating outputs to fp32.
        strict_ddp_mode: every parameter must be a plain data-parallel tensor (no DTensor).
        verbose: log the chunk search and layout.
        device: Colossal-AI's ``device`` argument; must be the accelerator's current device.
        search_range_mb, min_chunk_size_mb: older spellings of the ``_m`` arguments.

    Example:
        >>> model = GeminiDDP(torch.nn.Linear(8, 8), mixed_precision=torch.bfloat16)
        >>> opt = GeminiOptimizer(HybridAdam(model.parameters()), model)  # doctest: +SKIP
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        chunk_config_dict: dict[str, Any] | None = None,
        chunk_init_device: torch.device | str | None = None,
        placement_policy: str = "static",
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        search_range_m: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        memstats: Any = None,
        mixed_precision: torch.dtype = torch.float16,
        process_group: dist.ProcessGroup | None = None,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        device_memory_budget: int | None = None,
        verbose: bool = False,
        device: torch.device | str | int | None = None,
        search_range_mb: float | None = None,
        min_chunk_size_mb: float | None = None,
    ) -> None:
        search_range_m = _pick("search_range_m", search_range_m, "search_range_mb",
                               search_range_mb, 32)  # fmt: skip
        min_chunk_size_m = _pick("min_chunk_size_m", min_chunk_size_m, "min_chunk_size_mb",
                                 min_chunk_size_mb, 32)  # fmt: skip
        # ColoParameters: Gemini keeps their pieces, data-parallel over their ProcessGroup's dp
        process_group = prepare_dtensor_params(module, process_group)
        compute = self._check_args(module, mixed_precision, device, chunk_init_device,
                                   strict_ddp_mode)  # fmt: skip
        super().__init__(module)
        self.dtype = mixed_precision
        self.compute_device = compute
        self.force_outputs_fp32 = force_outputs_fp32
        self.pin_memory = pin_memory
        self.process_group = process_group
        lazy = list(lazy_named_tensors(module))  # built in a LazyInitContext: filled by replay
        if not lazy:
            self._prepare_module(module, compute)
        if chunk_config_dict is None:
            chunk_config_dict, result = find_chunk_configuration(
                module, search_range_m, min_chunk_size_m, hidden_dim
            )
            if verbose and _is_first_rank():
                _logger.info(result.report())
        self.chunk_manager = ChunkManager(unique_params(module), _chunk_size(chunk_config_dict),
                                          mixed_precision, process_group, compute,
                                          alone=tied_params(module))  # fmt: skip
        self.policy = create_placement_policy(
            placement_policy,
            device=compute,
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio,
            memstats=memstats,
            device_memory_budget=device_memory_budget,
        )
        self._build_chunks(chunk_init_device, lazy)
        if lazy:
            self._prepare_module(module, compute)
        # a device budget (auto/const) alone decides what stays gathered: no holding there
        hold = isinstance(self.policy, StaticPlacementPolicy)
        self.hooks = GeminiHooks(self.chunk_manager, self.policy, hold=hold)
        self.hooks.install(module)
        self._io = FullTensorIO(module, self.chunk_manager)
        self._no_sync = False
        if verbose and _is_first_rank():
            _logger.info("Gemini chunks: %s", [repr(c) for c in self.chunk_manager])

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _check_args(
        module: nn.Module,
        dtype: torch.dtype,
        device: torch.device | str | int | None,
        chunk_init_device: torch.device | str | None,
        strict: bool,
    ) -> torch.device:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
        if dtype not in _DTYPES:
            raise ValueError(
                f"mixed_precision={dtype!r} is not supported; pass torch.float16, "
                "torch.bfloat16 or torch.float32."
            )
        compute = torch.device(get_accelerator().get_current_device())
        if device is not None:
            wanted = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
            if wanted.type != compute.type or (
                wanted.index is not None and compute.index is not None and wanted != compute
            ):
                raise ValueError(
                    f"device={device!r} is not this process's accelerator device {compute}; "
                    "Gemini computes there only. Omit device or pass get_current_device()."
                )
        if chunk_init_device is not None and torch.device(chunk_init_device).type not in (
            compute.type,
            "cpu",
        ):
            raise ValueError(
                f"chunk_init_device={chunk_init_device!r} must be the compute device "
                f"({compute}) or 'cpu'."
            )
        for name, p in module.named_parameters():
            if type(p.data).__name__ == "DTensor" or (p.device.type == "meta" and not is_lazy(p)):
                raise NotImplementedError(
                    f"parameter {name} is a {'meta' if p.device.type == 'meta' else 'D'}Tensor "
                    f"(strict_ddp_mode={strict}); GeminiDDP needs plain, materialised, "
                    "replicated parameters. Materialise the model first."
                )
        return compute

    def _prepare_module(self, module: nn.Module, compute: torch.device) -> None:
        """Buffers to the device in the working dtype, identical on every rank."""
        for sub in module.modules():
            for key, buf in list(sub._buffers.items()):
                if buf is None:
                    continue
                buf = buf.to(compute)
                if buf.is_floating_point():
                    buf = buf.to(self.dtype)
                if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
                    src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
                    dist.broadcast(buf, src, group=self.process_group)
                sub._buffers[key] = buf

    def _build_chunks(
        self, chunk_init_device: torch.device | str | None, lazy: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Place the chunks, then fill them from rank 0's parameter values (COLLECTIVE); a lazy
        model's chunks are filled shard by shard from its record."""
        manager, compute = self.chunk_manager, self.compute_device
        if chunk_init_device is not None and torch.device(chunk_init_device).type == "cpu":
            for chunk in manager:
                chunk.device_type = "cpu"
        self.policy.setup(manager)
        src = 0
        if dist.is_initialized() and self.process_group is not None:
            src = dist.get_global_rank(self.process_group, 0)
        for chunk in manager:
            chunk.keep_gathered = not self.policy.keep_params_sharded(chunk)
            chunk.optim_on_host = not self.policy.optim_on_device(chunk)
            chunk.optim_device = torch.device("cpu") if chunk.optim_on_host else compute
            chunk.pin_memory = self.pin_memory and self.compute_device.type != "cpu"
        if lazy:
            fill_chunks_lazily(manager, lazy, self.process_group, compute)
            return
        for chunk in manager:
            full = torch.zeros(chunk.chunk_size, dtype=torch.float32, device=self.compute_device)
            for info in chunk.tensors:
                full[info.offset : info.offset + info.numel].copy_(info.param.data.reshape(-1))
            if dist.is_initialized() and chunk.world_size > 1:
                dist.broadcast(full, src, group=self.process_group)
            chunk.initialise(full)

    def _apply(self, fn: Any, recurse: bool = True) -> GeminiDDP:
        """``.to()`` / ``.cuda()`` / ``.half()`` after wrapping: only no-ops on parameters are
        allowed (the chunks own their placement and dtype); buffers follow ``fn``."""
        if hasattr(self, "chunk_manager"):
            for name, p in self.module.named_parameters():
                moved = fn(p.data)
                if moved.dtype != p.dtype or moved.device != p.device:
                    raise NotImplementedError(
                        f"moving or casting parameter {name} of a GeminiDDP model "
                        f"({p.dtype}, {p.device} -> {moved.dtype}, {moved.device}) is not "
                        "supported: chunks own placement and dtype. Move or cast the model "
                        "before wrapping, and choose the dtype with mixed_precision."
                    )
        super()._apply(fn, recurse)
        return self

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; floating inputs are cast to the working dtype."""
        self.hooks.start_forward()
        if self.dtype != torch.float32:
            args, kwargs = cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)
        try:
            with payload_saving_hooks(self.chunk_manager):  # released chunks really free memory
                out = self.module(*args, **kwargs)
        finally:
            self.hooks.end_forward()
        if self.force_outputs_fp32:
            out = cast_floating(out, torch.float32)
        return out

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` and finish the gradient reduction (COLLECTIVE)."""
        loss.backward()
        self.finish_backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Back-propagate from ``tensor`` with upstream ``grad`` and finish the reduction."""
        torch.autograd.backward(tensor, grad)
        self.finish_backward()

    def finish_backward(self) -> None:
        """Reduce chunks whose parameters got no gradient and release every chunk
        (COLLECTIVE). Called by :meth:`backward` and the optimizer; safe to call twice."""
        self.hooks.finish_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation. Gemini stays correct without this context: every backward
        reduce-scatters its chunks' gradients and adds them to the fp32 gradient shards, which
        keep accumulating until the optimizer steps; gradients never exist unsharded between
        backward passes. So the context saves no communication; it exists for API parity."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # ------------------------------------------------------------------ full tensors
    def names_not_held(self) -> list[str]:
        """Names of the parameters this rank holds none of (checkpoint loading skips them)."""
        return self._io.names_not_held()

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(state-dict name, full tensor)`` for every parameter (fp32 master values, tied
        parameters once under their first name) and persistent buffer. COLLECTIVE, chunk by
        chunk: at most one chunk's full tensors are alive; copy what you keep."""
        self.finish_backward()
        return self._io.named_full_tensors()

    def load_full_tensors(self, items: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full tensors (name as in :meth:`named_full_tensors`, or a tied alias) into this
        rank's shards and masters. Not collective. Returns the names consumed."""
        return self._io.load_full_tensors(items)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shapes of every state-dict entry (tied aliases included)."""
        return self._io.full_shapes()

    def tied_aliases(self) -> dict[str, str]:
        """``{alias name: first name}`` of tied parameters."""
        return self._io.tied_aliases()

    def state_dict(  # type: ignore[override]
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        only_rank_0: bool = True,
    ) -> dict[str, Any]:
        """The full model state, keyed as the wrapped module's own ``state_dict`` (tied
        parameters under every name, in torch's order): parameters as fp32 CPU copies of the
        masters, persistent buffers as they are. COLLECTIVE (one all-gather per chunk).

        Args:
            destination: a dict to fill and return (default: a new ``OrderedDict``).
            prefix: prepended to every key.
            keep_vars: not supported (must be ``False``): the parameters exist only as chunk
                shards, so there are no full ``Parameter`` objects to return.
            only_rank_0: as in Colossal-AI, only the group's first rank gets the parameters'
                values; the others get empty tensors in their place (buffers everywhere).
                ``False``: every rank gets them.

        Raises:
            NotImplementedError: ``keep_vars=True``.
        """
        if keep_vars:
            raise NotImplementedError(
                "GeminiDDP.state_dict(keep_vars=True) is not supported: parameters exist only "
                "as chunk shards; use keep_vars=False (full detached copies)."
            )
        keep = not only_rank_0 or _group_rank(self.process_group) == 0
        params = {info.name for chunk in self.chunk_manager for info in chunk.tensors}
        full: dict[str, torch.Tensor] = {}
        for name, tensor in self.named_full_tensors():
            if name not in params:
                full[name] = tensor.detach()
            elif keep:
                full[name] = tensor.detach().to("cpu", copy=True)
            else:
                full[name] = torch.empty(0)
        for alias, first in self.tied_aliases().items():
            full[alias] = full[first]
        out: dict[str, Any] = destination if destination is not None else OrderedDict()
        if destination is None:
            out._metadata = OrderedDict()  # type: ignore[attr-defined]
        for mod_name, sub in self.module.named_modules(remove_duplicate=False):
            if destination is None:
                key = prefix + mod_name if mod_name else prefix[:-1]
                out._metadata[key] = {"version": sub._version}  # type: ignore[attr-defined]
            local = [*sub._parameters, *sub._buffers]
            for name in local:
                qualified = f"{mod_name}.{name}" if mod_name else name
                if qualified in full:
                    out[prefix + qualified] = full[qualified]
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a full state dict (as :meth:`state_dict` with ``only_rank_0=False`` or the plain
        module returns it): every rank copies its slice of each parameter into its shards and
        masters, and the buffers. Not collective: each rank reads its own ``state_dict``.

        Args:
            state_dict: full tensors by name (tied parameters under any of their names).
            strict: raise when keys are missing or unexpected.
            assign: not supported (must be ``False``): chunks own the storage.

        Returns:
            ``(missing_keys, unexpected_keys)`` as torch's ``_IncompatibleKeys``.

        Raises:
            RuntimeError: ``strict`` and keys are missing or unexpected.
            ValueError: a tensor's shape differs from the model's.
        """
        if assign:
            raise NotImplementedError("GeminiDDP.load_state_dict does not support assign=True.")
        consumed = self.load_full_tensors(state_dict.items())
        expected = set(self.full_shapes())
        missing = sorted(expected - consumed - set(self.tied_aliases()))
        unexpected = sorted(set(state_dict) - consumed)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for GeminiDDP: missing keys {missing}, "
                f"unexpected keys {unexpected}."
            )
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _chunk_size(config: dict[str, Any]) -> int:
    size = config.get("chunk_size") if isinstance(config, dict) else None
    unknown = set(config) - {"chunk_size", "keep_gathered"} if isinstance(config, dict) else set()
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or unknown:
        raise ValueError(
            f"chunk_config_dict={config!r}: expected {{'chunk_size': positive int}} (elements), "
            "e.g. the entry config[N] of what search_chunk_configuration returns (keyed by the "
            "group size N)."
        )
    if config.get("keep_gathered"):
        raise NotImplementedError(
            "chunk_config_dict keep_gathered=True: use shard_param_frac=0.0 instead."
        )
    return size


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _is_first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
