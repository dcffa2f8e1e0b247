"""``Experts``: this rank's share of a layer's experts, computed together in one batched call.

``Experts(expert=VanillaFFN, num_experts=E, **expert_args)`` builds the ``E / ep_size`` experts of
this rank (global indices ``ep_rank * E_local ...``; see
:class:`~kolossos.moe.parallel_info.MoeParallelInfo`) from the user's class, then *stacks* their
parameters: every parameter of the expert class becomes one ``nn.Parameter`` of shape
``[E_local, *shape]`` (``experts.<name>``), and ``forward`` maps the class's own ``forward``
over the leading dimension with ``torch.func.vmap``, so a two-layer FFN runs as two batched
matmuls over ``[E_local, C, H]`` whatever ``E_local`` is, never a Python loop over experts.

Expert ``g`` is initialised from seed ``MOE_CONTEXT.seed + g`` (:func:`moe_set_seed`; without
it, from one number drawn from the global generator), so the experts differ from rank to rank,
yet a model built at any expert-parallel size starts from the same experts.

Checkpoint layout: :meth:`Experts.expert_state_dict` names each expert's tensors as the
unstacked class would, under its *global* index (``"<g>.<name>"``, the Hugging Face per-expert
layout), and :meth:`Experts.load_expert_state_dict` picks this rank's experts out of such a
dict, so a checkpoint saved at one ``ep_size`` loads at any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call, vmap

from kolossos.moe.context import MOE_CONTEXT
from kolossos.moe.parallel_info import MoeParallelInfo

__all__ = ["Experts"]


def _pick_class(expert: type[nn.Module] | None, expert_cls: type[nn.Module] | None) -> type:
    chosen = expert if expert is not None else expert_cls
    if (expert is None) == (expert_cls is None) or not isinstance(chosen, type):
        raise TypeError(
            f"Experts needs the expert class once, as expert=... (or expert_cls=...); got "
            f"expert={expert!r}, expert_cls={expert_cls!r}."
        )
    if not issubclass(chosen, nn.Module):
        raise TypeError(f"Experts: the expert class {chosen.__name__} must be an nn.Module.")
    return chosen


def _seeded(cls: type, seed: int, kwargs: dict[str, Any]) -> nn.Module:
    """``cls(**kwargs)`` built with the generators seeded by ``seed``, leaving them as found."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        module: nn.Module = cls(**kwargs)
    return module


def _set_param(root: nn.Module, name: str, value: nn.Parameter) -> None:
    *path, leaf = name.split(".")
    owner = root.get_submodule(".".join(path)) if path else root
    delattr(owner, leaf)
    owner.register_parameter(leaf, value)


class Experts(nn.Module):
    """The experts of one MoE layer that live on this rank, stacked (see the module docstring).

    Args:
        expert: the class of every expert (Colossal-AI's ``expert=``; ``expert_cls=`` also
            accepted). It must not hold buffers.
        num_experts: the layer's total number of experts (a multiple of the expert-parallel
            size).
        parallel_info: the expert-parallel layout (default: ``MOE_CONTEXT.parallel_info``).
        **expert_args: the arguments of the expert class.

    Raises:
        TypeError: no expert class, or not a module.
        ValueError: ``num_experts`` not a multiple of ``ep_size``.
        NotImplementedError: the expert class has buffers.

    Example:
        >>> experts = Experts(expert=nn.Linear, num_experts=4, in_features=8, out_features=8)
        >>> experts.experts.weight.shape, experts(torch.ones(4, 3, 8)).shape
        (torch.Size([4, 8, 8]), torch.Size([4, 3, 8]))
    """

    def __init__(
        self,
        expert: type[nn.Module] | None = None,
        num_experts: int = 1,
        *,
        expert_cls: type[nn.Module] | None = None,
        parallel_info: MoeParallelInfo | None = None,
        **expert_args: Any,
    ) -> None:
        super().__init__()
        cls = _pick_class(expert, expert_cls)
        info = parallel_info if parallel_info is not None else MOE_CONTEXT.parallel_info
        local = info.local_experts(num_experts)
        base = MOE_CONTEXT.seed
        if base is None:  # one draw from the global stream, the same count at every ep size
            base = int(torch.randint(0, 2**31 - 1, ()).item())
        built = [_seeded(cls, base + g, expert_args) for g in local]
        template = built[0]
        if any(True for _ in template.buffers()):
            raise NotImplementedError(
                f"Experts: {cls.__name__} holds buffers, which stacked experts do not support; "
                "use an expert without buffers (e.g. LayerNorm instead of BatchNorm)."
            )
        for name, _ in list(template.named_parameters()):
            per_expert = [m.get_parameter(name).detach() for m in built]
            stacked = nn.Parameter(torch.stack(per_expert))
            vars(stacked)["moe_info"] = info  # MoeGradientHandler's contract
            _set_param(template, name, stacked)
        self.experts = template
        self.num_total_experts = num_experts
        self.num_local_experts = len(local)
        self.global_indices = local
        self.moe_info = info

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs[i]`` through local expert ``i``: ``[E_local, C, H] -> [E_local, C, H']``."""
        if inputs.shape[0] != self.num_local_experts:
            raise ValueError(
                f"Experts input of shape {tuple(inputs.shape)}: the first dimension must be "
                f"the {self.num_local_experts} local experts."
            )
        params: dict[str, torch.Tensor] = dict(self.experts.named_parameters())

        def one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = functional_call(self.experts, p, (x,))
            return out

        out: torch.Tensor = vmap(one, randomness="different")(params, inputs)
        return out

    def expert_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's experts, one entry per expert and tensor: ``"<global index>.<name>"``
        (detached views)."""
        return {
            f"{g}.{name}": p.detach()[i]
            for name, p in self.experts.named_parameters()
            for i, g in enumerate(self.global_indices)
        }

    def load_expert_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's experts out of a per-expert dict (any ``ep_size`` wrote it).

        Raises:
            KeyError: an expert tensor of this rank is missing.
        """
        with torch.no_grad():
            for name, p in self.experts.named_parameters():
                for i, g in enumerate(self.global_indices):
                    key = f"{g}.{name}"
                    if key not in state:
                        raise KeyError(f"expert checkpoint lacks {key!r} (expert {g}, {name}).")
                    p[i].copy_(state[key])
