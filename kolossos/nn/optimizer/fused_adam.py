"""FusedAdam: Adam/AdamW through PyTorch's fused multi-tensor kernel on any device."""

from __future__ import annotations

from kolossos.nn.optimizer._adam_base import AdamBase, ParamsT

__all__ = ["FusedAdam"]


class FusedAdam(AdamBase):
    """Adam/AdamW in one fused kernel launch per device and dtype (Colossal-AI's ``FusedAdam``).

    Upstream this needs a CUDA extension built at install time; here it is PyTorch's own fused
    Adam kernel (CUDA, CPU, XPU, MPS), with an automatic ``torch._foreach_*`` fallback elsewhere.
    Unlike :class:`CPUAdam`, states have the parameter's dtype (as in apex/Colossal-AI's
    FusedAdam and ``torch.optim.AdamW``). AMSGrad is supported.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: apply Adam's bias correction.
        betas: decay rates of the first and second moment.
        eps: added to the denominator.
        adamw_mode: True for decoupled weight decay (AdamW), False for L2 (Adam).
        weight_decay: weight decay.
        amsgrad: use the maximum of past second moments (AMSGrad).
        set_grad_none: ``zero_grad()`` sets gradients to ``None`` by default (else zeros them).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = FusedAdam(model.parameters(), lr=1e-3)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    wide_states = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            amsgrad=amsgrad,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset the gradients: to ``None`` if ``set_to_none`` (default: ``set_grad_none``)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)
