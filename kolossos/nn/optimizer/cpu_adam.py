"""CPUAdam: Adam/AdamW at memory bandwidth on the CPU, no compiler needed, optional NVMe offload."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import Tensor

from kolossos.nn.optimizer._adam_base import AdamBase, ParamsT
from kolossos.nn.optimizer._adam_kernels import AdamHyper, adam_update
from kolossos.nn.optimizer.nvme import offloader
from kolossos.nn.optimizer.nvme.plan import select_offloaded

if TYPE_CHECKING:
    from kolossos.nn.optimizer.nvme.offloader import UpdateFn

__all__ = ["CPUAdam"]


class CPUAdam(AdamBase):
    """Adam (``adamw_mode=False``) or AdamW (default) for parameters that live on the CPU.

    A drop-in replacement for ``torch.optim.AdamW`` / ``torch.optim.Adam`` with Colossal-AI's
    signature. Each step runs PyTorch's own vectorised, multi-threaded fused kernel (no C++ build
    at install time or first use); it uses ``torch.get_num_threads()`` threads and never changes
    that setting. Parameters on an accelerator are updated there too.

    States are fp32 for fp32, bf16 and fp16 parameters (the update is computed in fp32 and
    rounded into the low-precision parameter), the parameter's dtype otherwise. ``state_dict()``
    has ``torch.optim.AdamW``'s format: checkpoints load into torch's optimizers and back.

    With ``nvme_offload_fraction > 0``, that share of the CPU parameters' states (by element
    count, whole parameters in order) lives in a file under ``nvme_offload_dir`` and is streamed
    through three 16 MiB buffers during ``step()``, reads and writes overlapping the update.
    The file is reserved when the optimizer is built (a full disk or unwritable directory fails
    here, not mid-training) and deleted automatically. Parameters added later with
    ``add_param_group`` keep their states in memory.

    Args:
        model_params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta**step`` (Adam's bias correction).
        betas: decay rates of the first and second moment.
        eps: added to the denominator.
        weight_decay: decoupled (AdamW) or L2 (Adam) weight decay, per ``adamw_mode``.
        adamw_mode: True for AdamW's decoupled weight decay, False for Adam's L2 penalty.
        nvme_offload_fraction: share of optimizer states kept on disk, in ``[0, 1]``.
        nvme_offload_dir: directory for the swap file; ``None`` makes a private temporary one
            (removed when the optimizer is closed or the interpreter exits).

    Raises:
        ValueError: an invalid hyper-parameter or fraction.
        NVMeOffloadError: the offload directory cannot be written or lacks space.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        model_params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | os.PathLike[str] | None = None,
        *,
        _extra_defaults: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            extra_defaults=_extra_defaults,
        )
        if not 0.0 <= float(nvme_offload_fraction) <= 1.0:
            raise ValueError(
                f"nvme_offload_fraction={nvme_offload_fraction!r}: the share of optimizer states "
                "offloaded must lie in [0, 1] (0 keeps everything in memory)"
            )
        if nvme_offload_dir is not None and not isinstance(nvme_offload_dir, str | os.PathLike):
            raise TypeError(f"nvme_offload_dir={nvme_offload_dir!r}: expected a path or None")
        self.nvme_offload_fraction = float(nvme_offload_fraction)
        self.nvme_offload_dir = nvme_offload_dir
        self._offloader: Any = None
        if self.nvme_offload_fraction > 0:
            self._offloader = self._make_offloader()

    def _make_offloader(self) -> Any:
        params = [(i, p) for i, g in enumerate(self.param_groups) for p in g["params"]]
        eligible = [(p.numel(), p.device.type == "cpu" and p.is_contiguous()) for _, p in params]
        chosen = select_offloaded(eligible, self.nvme_offload_fraction)
        offloaded = [gp for gp, take in zip(params, chosen, strict=True) if take]
        names = self.state_names(self.defaults)
        return offloader.StateOffloader(
            offloaded, names, self.state_dtype, self.nvme_offload_dir, offloader.DEFAULT_UNIT_BYTES
        )

    def rebuild_offloader(self) -> None:
        """Choose again which parameters' states go to disk, over the current param groups.

        Needed after a wrapper re-points the groups at other tensors (Gemini's master shards):
        the choice made at construction refers to the original parameters. Closes the old swap
        file first; states held in it are not carried over (call before the first step).
        """
        if self._offloader is not None:
            self._offloader.close()
            self._offloader = self._make_offloader()

    @property
    def nvme_offloaded_bytes(self) -> int:
        """Bytes of optimizer states kept on disk (0 without NVMe offload)."""
        return 0 if self._offloader is None else int(self._offloader.offloaded_bytes)

    def flush(self) -> None:
        """Wait until the offloaded states written by the last ``step()`` are in the swap file
        (``step()`` returns with them in flight, overlapping the next forward/backward)."""
        self._settle()

    def close(self) -> None:
        """Finish pending writes and delete the swap file. Idempotent; also runs at exit.

        The optimizer cannot step with offloaded states afterwards.
        """
        if self._offloader is not None:
            self._offloader.close()

    def _is_streamed(self, p: Tensor) -> bool:
        return self._offloader is not None and bool(self._offloader.holds(p))

    def _step_streamed(self, work: dict[int, tuple[list[Tensor], list[Tensor], AdamHyper]]) -> None:
        def update_with(hp: AdamHyper) -> UpdateFn:
            def update(
                ps: list[Tensor], gs: list[Tensor], states: list[list[Tensor]], ss: list[Tensor]
            ) -> None:
                maxes = states[2] if hp.amsgrad else None
                adam_update(ps, gs, states[0], states[1], maxes, ss, hp)

            return update

        self._offloader.step(
            {g: (params, steps) for g, (params, steps, _) in work.items()},
            {g: update_with(hp) for g, (_, _, hp) in work.items()},
        )

    def _settle(self) -> None:
        if self._offloader is not None:
            self._offloader.drain()

    def _export_streamed(self, p: Tensor) -> dict[str, Tensor]:
        states: dict[str, Tensor] = self._offloader.read_param_state(p)
        return states

    def _import_streamed(self, p: Tensor, states: dict[str, Tensor] | None) -> None:
        self._offloader.write_param_state(p, states)

    def __getstate__(self) -> dict[str, Any]:
        if self._offloader is not None:
            raise TypeError(
                f"a {type(self).__name__} with NVMe offload cannot be pickled or deep-copied "
                "(it owns a swap file); save optimizer.state_dict() instead"
            )
        state: dict[str, Any] = super().__getstate__()
        return state
