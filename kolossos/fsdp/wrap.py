"""Which submodules get their own ``fully_shard`` call (FSDP "units"), before the root gets one.

Each unit all-gathers its parameters in one collective before its forward and reduce-scatters its
gradients in one after its backward, so units bound peak memory and let communication overlap
compute. The policy (``auto_wrap_policy``) may be:

* ``None``: every transformer block of a Hugging Face model (the classes it lists in
  ``_no_split_modules``, found anywhere inside the model), else every top-level child that has
  parameters;
* a set, list or tuple of module classes: every instance of them;
* an FSDP1 policy object (``ModuleWrapPolicy``, ``CustomPolicy``), asked as FSDP1 would;
* an FSDP1 policy callable ``fn(module, recurse, nonwrapped_numel) -> bool`` (e.g.
  ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``), walked the way FSDP1's
  recursive wrapping walks it: bottom-up, a module's ``nonwrapped_numel`` counting only the
  parameters not already inside a chosen descendant.

A unit may not share a parameter with modules outside it (FSDP2 cannot gather one tensor in two
units): the default policy skips such modules (they stay in the root's unit), a user policy that
selects one is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

__all__ = ["Unit", "plan_units", "transformer_block_classes"]


@dataclass(frozen=True)
class Unit:
    """A submodule that gets its own ``fully_shard``."""

    name: str
    """its qualified name in the model"""
    module: nn.Module
    fp32: bool = False
    """computes in fp32 whatever the mixed precision (FSDP1's ``_module_classes_to_ignore``)"""


def transformer_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The block classes Hugging Face models inside ``model`` declare as ``_no_split_modules``."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            names.update(str(n) for n in declared)
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _numel(params: Iterable[nn.Parameter], skip: set[int]) -> int:
    return sum(p.numel() for p in params if id(p) not in skip)


def _callable_units(
    root: nn.Module, policy: Callable[..., bool], ignored: set[nn.Module], skip: set[int]
) -> list[nn.Module]:
    """Walk an FSDP1 policy callable bottom-up; return the modules it wraps (root excluded)."""
    chosen: list[nn.Module] = []
    claimed: set[int] = set(skip)  # parameters already inside a chosen unit (or ignored)

    def visit(module: nn.Module) -> None:
        numel = _numel(module.parameters(), claimed)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return
        for child in module.children():
            if child not in ignored:
                visit(child)
        remaining = _numel(module.parameters(), claimed)
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=remaining):
            chosen.append(module)
            claimed.update(id(p) for p in module.parameters())

    visit(root)
    return chosen


def _policy_units(
    root: nn.Module, policy: Any, ignored: set[nn.Module], skip: set[int]
) -> tuple[list[nn.Module], bool]:
    """The modules ``policy`` selects, and whether they came from the default policy."""
    from torch.distributed.fsdp.wrap import _Policy

    if policy is None:
        classes = transformer_block_classes(root)
        if classes:
            return [m for m in root.modules() if type(m) in classes], True
        return [c for c in root.children() if any(True for _ in c.parameters())], True
    if isinstance(policy, (set, frozenset, list, tuple)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"auto_wrap_policy holds {bad!r}; a collection holds Module classes.")
        wanted = tuple(policy)
        return [m for m in root.modules() if isinstance(m, wanted)], False
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root, ignored, {})
        overrides = {type(m).__name__: kw for m, kw in targets.items() if kw}
        if overrides:
            raise NotImplementedError(
                f"auto_wrap_policy returns per-module FSDP arguments {overrides!r}; FSDP2 units "
                "take the plugin's settings. Return True/False from the policy instead."
            )
        return [m for m in root.modules() if m in targets], False
    if callable(policy):
        return _callable_units(root, policy, ignored, skip), False
    raise TypeError(
        f"auto_wrap_policy={policy!r} must be None, a set of Module classes, an FSDP1 policy "
        "(ModuleWrapPolicy, CustomPolicy) or a callable(module, recurse, nonwrapped_numel)."
    )


def _shares_outside(module: nn.Module, sites: dict[int, int]) -> str | None:
    """The name of a parameter of ``module`` that is also registered outside it, if any."""
    inside: dict[int, int] = {}
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        inside[id(p)] = inside.get(id(p), 0) + 1
        names.setdefault(id(p), name)
    return next((names[i] for i, n in inside.items() if n < sites[i]), None)


def plan_units(
    model: nn.Module,
    policy: Any,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
    fp32_classes: tuple[type[nn.Module], ...] = (),
) -> list[Unit]:
    """The units of ``model`` in forward (registration) order; the root is not among them.

    Call ``fully_shard`` on them in reverse order (descendants before ancestors), then on the root.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> [unit.name for unit in plan_units(model, None)]
        ['0', '2']

    Raises:
        TypeError: a policy of an unknown kind.
        ValueError: a user policy selected a module sharing a parameter with the rest of the model.
        NotImplementedError: a policy asking for per-module FSDP arguments.
    """
    ignored = set(ignored_modules)
    ignored_inside = {m for ig in ignored for m in ig.modules()}
    skip = {id(p) for m in ignored for p in m.parameters()} | {id(p) for p in ignored_params}
    selected, default = _policy_units(model, policy, ignored, skip)
    wanted = {id(m) for m in selected}
    fp32_wanted = {
        id(m)
        for m in model.modules()
        if fp32_classes
        and isinstance(m, fp32_classes)
        and next(m.parameters(False), None) is not None
    }
    sites: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        sites[id(p)] = sites.get(id(p), 0) + 1
    units = []
    for name, module in model.named_modules():
        if module is model or module in ignored_inside:
            continue
        if id(module) not in wanted and id(module) not in fp32_wanted:
            continue
        if _numel(module.parameters(), skip) == 0:
            continue
        shared = _shares_outside(module, sites)
        if shared is not None:
            if default:
                continue
            raise ValueError(
                f"auto_wrap_policy selected {name!r}, whose parameter {shared!r} is shared with "
                "modules outside it (tied weights); FSDP2 cannot gather one tensor in two units. "
                "Leave that module out of the policy (it then belongs to its parent's unit)."
            )
        units.append(Unit(name, module, fp32=id(module) in fp32_wanted))
    return units
