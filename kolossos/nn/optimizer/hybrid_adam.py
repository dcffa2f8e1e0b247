"""HybridAdam: CPUAdam for CPU parameters, the fused accelerator kernel for the others."""

from __future__ import annotations

import os
from typing import Any

from kolossos.nn.optimizer._adam_base import ParamsT
from kolossos.nn.optimizer.cpu_adam import CPUAdam

__all__ = ["HybridAdam"]


class HybridAdam(CPUAdam):
    """Adam/AdamW for a mix of CPU and accelerator parameters (Colossal-AI's ``HybridAdam``).

    Each parameter is updated where it lives: CPU parameters by the vectorised CPU kernel, those
    on an accelerator (e.g. CUDA) by PyTorch's fused kernel on that device, in one launch per
    device and dtype. Parameter and gradient must share a device. States are fp32 for fp32/bf16/
    fp16 parameters and live beside their parameter; with ``nvme_offload_fraction > 0`` a share
    of the *CPU* parameters' states goes to disk (accelerator states never do). Arguments and
    behaviour are otherwise those of :class:`CPUAdam`.

    Args:
        model_params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: apply Adam's bias correction.
        betas: decay rates of the first and second moment.
        eps: added to the denominator.
        weight_decay: decoupled (AdamW) or L2 (Adam) weight decay, per ``adamw_mode``.
        adamw_mode: True for AdamW, False for Adam with L2 penalty.
        nvme_offload_fraction: share of CPU optimizer states kept on disk, in ``[0, 1]``.
        nvme_offload_dir: directory for the swap file (``None``: a private temporary one).
        **defaults: extra per-group defaults stored in ``param_groups`` (as upstream).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = HybridAdam(model.parameters(), lr=1e-3, nvme_offload_fraction=0.0)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
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
        **defaults: Any,
    ) -> None:
        if defaults.get("amsgrad"):
            raise NotImplementedError(
                "HybridAdam does not implement AMSGrad (neither does Colossal-AI's); "
                "use kolossos.nn.optimizer.FusedAdam(amsgrad=True)"
            )
        defaults.pop("amsgrad", None)
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
            _extra_defaults=defaults,
        )
