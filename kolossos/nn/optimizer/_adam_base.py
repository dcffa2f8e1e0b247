"""What CPUAdam, HybridAdam and FusedAdam share: validation, state layout, ``step()`` and a state
dict in ``torch.optim.AdamW``'s format (``step``, ``exp_avg``, ``exp_avg_sq``[,
``max_exp_avg_sq``]), so checkpoints move freely between them and torch's Adam/AdamW."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from kolossos.nn.optimizer._adam_kernels import AdamHyper, adam_update
from kolossos.nn.optimizer._common import (
    closure_loss,
    load_groups_then_states,
    to_state_tensor,
    widened,
)

__all__ = ["AdamBase", "check_hyper"]

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ``ValueError`` for hyper-parameters Adam-like optimizers cannot use."""
    if not float(lr) >= 0.0:
        raise ValueError(f"lr={lr!r}: the learning rate must be >= 0")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"betas={betas!r}: both betas must lie in [0, 1), e.g. (0.9, 0.999)")
    if not float(eps) >= 0.0:
        raise ValueError(f"eps={eps!r}: eps must be >= 0")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"weight_decay={weight_decay!r}: weight decay must be >= 0")


class AdamBase(torch.optim.Optimizer):
    """Adam/AdamW over :func:`adam_update`; subclasses choose the state dtype and offloading."""

    #: keep fp32 states for fp16/bf16 parameters (CPUAdam, HybridAdam) instead of their dtype
    wide_states: bool = True

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float,
        bias_correction: bool,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        adamw_mode: bool,
        amsgrad: bool = False,
        extra_defaults: dict[str, Any] | None = None,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            amsgrad=amsgrad,
            **(extra_defaults or {}),
        )
        super().__init__(params, defaults)
        self.adamw_mode = adamw_mode
        self._narrow_grad_scale: Tensor | None = None

    @contextlib.contextmanager
    def narrow_grads_scaled(self, scale: Tensor | None) -> Iterator[None]:
        """Within the block, ``step()`` multiplies gradients narrower than their states by
        ``scale`` as it widens them (``None``: leaves them as they are). For a caller that keeps
        bf16 gradients of fp32 parameters and defers a clipping factor to the update
        (:class:`~kolossos.zero.gemini.GeminiOptimizer`); other gradients are not scaled."""
        self._narrow_grad_scale = scale
        try:
            yield
        finally:
            self._narrow_grad_scale = None

    def is_streamed(self, p: Tensor) -> bool:
        """Whether ``p``'s states are streamed from NVMe instead of living in ``self.state``."""
        return self._is_streamed(p)

    def streamed_state(self, p: Tensor) -> dict[str, Tensor]:
        """``p``'s NVMe-streamed states, read back (empty when ``p`` is not streamed)."""
        if not self._is_streamed(p):
            return {}
        self._settle()
        return self._export_streamed(p)

    # subclass hooks
    def _is_streamed(self, p: Tensor) -> bool:
        """Whether ``p``'s states live outside ``self.state`` (NVMe offload)."""
        return False

    def _step_streamed(self, work: dict[int, tuple[list[Tensor], list[Tensor], AdamHyper]]) -> None:
        """Update streamed parameters: group index -> (params, their steps, hyper-parameters)."""
        raise AssertionError("no parameter is streamed")

    def _settle(self) -> None:
        """Finish background work before the states are read or replaced."""

    def _export_streamed(self, p: Tensor) -> dict[str, Tensor]:
        raise AssertionError("no parameter is streamed")

    def _import_streamed(self, p: Tensor, states: dict[str, Tensor] | None) -> None:
        raise AssertionError("no parameter is streamed")

    # state layout
    def state_dtype(self, p: Tensor) -> torch.dtype:
        """The dtype of ``p``'s ``exp_avg``/``exp_avg_sq``."""
        return widened(p.dtype) if self.wide_states else p.dtype

    @staticmethod
    def state_names(group: dict[str, Any]) -> tuple[str, ...]:
        """Names of the per-element states of a group's parameters."""
        extra = ("max_exp_avg_sq",) if group.get("amsgrad", False) else ()
        return ("exp_avg", "exp_avg_sq", *extra)

    def _new_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
        if not self._is_streamed(p):
            dtype = self.state_dtype(p)
            for name in self.state_names(group):
                state[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; returns ``closure()``'s loss if a closure is given."""
        loss = closure_loss(closure)
        self._settle()
        streamed_work: dict[int, tuple[list[Tensor], list[Tensor], AdamHyper]] = {}
        for index, group in enumerate(self.param_groups):
            hp = _hyper(group)
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            maxes: list[Tensor] = []
            steps: list[Tensor] = []
            streamed: list[Tensor] = []
            streamed_steps: list[Tensor] = []
            bumped: list[Tensor] = []
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:  # (torch itself rejects a grad of another shape/device/dtype)
                    raise RuntimeError(
                        "Adam does not support sparse gradients; use torch.optim.SparseAdam"
                    )
                state = self.state[p]
                if not state:
                    state.update(self._new_state(p, group))
                bumped.append(state["step"])
                if self._is_streamed(p):
                    streamed.append(p)
                    streamed_steps.append(state["step"])
                    continue
                params.append(p)
                grads.append(grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if hp.amsgrad:
                    maxes.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            if bumped:
                torch._foreach_add_(bumped, 1.0)
            if params:
                adam_update(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    maxes if hp.amsgrad else None,
                    steps,
                    hp,
                    narrow_grad_scale=self._narrow_grad_scale,
                )
            if streamed:
                streamed_work[index] = (streamed, streamed_steps, hp)
        if streamed_work:  # after the resident updates, in one pipeline across all groups
            self._step_streamed(streamed_work)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.AdamW``'s format; offloaded states are read back from disk
        into fresh tensors (so saving needs memory for them)."""
        self._settle()
        sd = super().state_dict()
        for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups)):
            if self._is_streamed(p) and i in sd["state"]:
                sd["state"][i] = {**sd["state"][i], **self._export_streamed(p)}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class, of the other kolossos Adams or of ``torch.optim``
        Adam/AdamW. States keep this optimizer's dtype policy (fp32 for bf16 parameters)."""
        self._settle()
        for group, p, entry in load_groups_then_states(self, state_dict):
            names = self.state_names(group)
            if self._is_streamed(p):
                self._import_streamed(p, None if entry is None else _pick(entry, names))
            if entry is None:
                continue
            step = torch.as_tensor(entry.get("step", 0)).to(device=p.device, dtype=torch.float32)
            state: dict[str, Any] = {"step": step.clone().reshape(())}
            if not self._is_streamed(p):
                for name in names:
                    value = entry.get(name)
                    if value is None:
                        value = torch.zeros_like(p, dtype=self.state_dtype(p))
                    state[name] = to_state_tensor(value, p, self.state_dtype(p), name)
            self.state[p] = state


def _pick(entry: dict[str, Any], names: tuple[str, ...]) -> dict[str, Tensor]:
    return {name: entry[name] for name in names if name in entry}


def _hyper(group: dict[str, Any]) -> AdamHyper:
    beta1, beta2 = group["betas"]
    return AdamHyper(
        lr=group["lr"],
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        adamw_mode=bool(group["adamw_mode"]),
        bias_correction=bool(group["bias_correction"]),
        amsgrad=bool(group.get("amsgrad", False)),
    )
