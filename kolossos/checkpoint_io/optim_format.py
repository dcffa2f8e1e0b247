"""The name-keyed optimizer checkpoint format (version 1), independent of ranks and layout.

A torch ``optimizer.state_dict()`` identifies parameters by position and stores whatever slice of
the state a rank holds. Ours identifies them by parameter name and always stores full tensors with
their global shape, so it loads into any plugin, world size or parallel layout::

    header = {
        "format": "kolossos.optim", "version": 1,
        "named": True,                       # False: names are positional fallbacks
        "param_groups": [{"lr": 0.1, ..., "params": ["fc.weight", "fc.bias"]}, ...],
        "param_shapes": {"fc.weight": [4, 8], "fc.bias": [4]},
        "loss_scaler": {"scale": 1024.0, ...},  # only with fp16 loss scaling
    }
    state = {"fc.weight": {"step": tensor(3.), "exp_avg": <4x8>, "exp_avg_sq": <4x8>}, ...}

A state tensor with the parameter's shape is *sliceable*: a sharding plugin cuts its own piece out
of it at load time. Any other state value (``step``, scalars, factored statistics) is replicated.
See ``docs/checkpoint.md``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from kolossos.checkpoint_io.errors import CheckpointError, LoadReport
from kolossos.checkpoint_io.param_names import is_positional_name

__all__ = [
    "OPTIM_FORMAT",
    "OPTIM_FORMAT_VERSION",
    "build_header",
    "check_header",
    "load_group_hyperparameters",
    "match_optimizer",
    "named_param_groups",
    "to_torch_state_dict",
]

OPTIM_FORMAT = "kolossos.optim"
OPTIM_FORMAT_VERSION = 1


def named_param_groups(optim: Optimizer, names: list[list[str]]) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameter names in place of the parameters."""
    groups = []
    for group, group_names in zip(optim.param_groups, names, strict=True):
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(group_names)
        groups.append(entry)
    return groups


def build_header(
    groups: list[dict[str, Any]], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The header stored with every optimizer checkpoint (see the module docstring)."""
    all_names = [n for g in groups for n in g["params"]]
    return {
        "format": OPTIM_FORMAT,
        "version": OPTIM_FORMAT_VERSION,
        "named": not any(is_positional_name(n) for n in all_names),
        "param_groups": groups,
        "param_shapes": {n: list(shapes[n]) for n in all_names},
    }


def check_header(header: Any, path: str) -> dict[str, Any]:
    """Validate a loaded header, raising :class:`CheckpointError` naming ``path`` if it is bad."""
    if not isinstance(header, dict) or header.get("format") != OPTIM_FORMAT:
        raise CheckpointError(
            f"{path!r} is not a kolossos optimizer checkpoint (no '{OPTIM_FORMAT}' header)"
        )
    version = header.get("version")
    if not isinstance(version, int) or version > OPTIM_FORMAT_VERSION:
        raise CheckpointError(
            f"optimizer checkpoint {path!r} has format version {version!r}; this kolossos reads "
            f"versions up to {OPTIM_FORMAT_VERSION}. Upgrade kolossos to load it."
        )
    groups = header.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointError(f"optimizer checkpoint {path!r} has malformed 'param_groups'")
    return header


def match_optimizer(
    target_names: list[list[str]],
    target_shapes: Mapping[str, tuple[int, ...]],
    header: Mapping[str, Any],
) -> tuple[dict[str, str], LoadReport]:
    """Map checkpoint entry names onto the target's parameter names and list every difference.

    Parameters are matched by name when both sides have real names, and by position (group and
    index) otherwise.

    Returns:
        ``{checkpoint name: target name}`` for the entries that fit, and the report of missing,
        unexpected and wrongly shaped parameters.
    """
    saved_groups = [list(g["params"]) for g in header["param_groups"]]
    saved_shapes = {n: tuple(s) for n, s in header["param_shapes"].items()}
    positional = not header.get("named", True) or any(
        is_positional_name(n) for group in target_names for n in group
    )
    if positional:
        pairs = [
            (s, t)
            for sg, tg in zip(saved_groups, target_names, strict=False)
            for s, t in zip(sg, tg, strict=False)
        ]
        matched = {s for s, _ in pairs}
        claimed = {t for _, t in pairs}
        missing = [t for tg in target_names for t in tg if t not in claimed]
        unexpected = [s for sg in saved_groups for s in sg if s not in matched]
    else:
        targets = {t for tg in target_names for t in tg}
        saved = [s for sg in saved_groups for s in sg]
        pairs = [(s, s) for s in saved if s in targets]
        missing = [t for tg in target_names for t in tg if t not in set(saved)]
        unexpected = [s for s in saved if s not in targets]
    mapping: dict[str, str] = {}
    mismatched = []
    for s, t in pairs:
        if saved_shapes.get(s) != tuple(target_shapes[t]):
            mismatched.append((t, saved_shapes.get(s, ()), tuple(target_shapes[t])))
        else:
            mapping[s] = t
    return mapping, LoadReport(tuple(missing), tuple(unexpected), tuple(mismatched))


def _hyperparams_for(
    target_group: list[str], saved_groups: list[dict[str, Any]], mapping: Mapping[str, str], g: int
) -> dict[str, Any]:
    """Hyper-parameters of the saved group holding the target group's first known parameter."""
    owner = {
        mapping[s]: i for i, sg in enumerate(saved_groups) for s in sg["params"] if s in mapping
    }
    index = next((owner[n] for n in target_group if n in owner), min(g, len(saved_groups) - 1))
    return {k: v for k, v in saved_groups[index].items() if k != "params"}


def to_torch_state_dict(
    target_names: list[list[str]],
    header: Mapping[str, Any],
    states: Iterator[tuple[str, dict[str, Any]]],
    mapping: Mapping[str, str],
) -> dict[str, Any]:
    """Build a positional ``optimizer.load_state_dict`` argument for the target optimizer.

    Args:
        target_names: the target optimizer's parameter names, group by group.
        header: the checkpoint header.
        states: ``(checkpoint name, state)`` pairs; names absent from ``mapping`` are skipped.
            Tensors are cloned (checkpoint files are memory-mapped).
        mapping: ``{checkpoint name: target name}`` from :func:`match_optimizer`.
    """
    position = {n: i for i, n in enumerate(n for group in target_names for n in group)}
    state: dict[int, dict[str, Any]] = {}
    for name, value in states:
        if name in mapping:
            state[position[mapping[name]]] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()
            }
    groups, start = [], 0
    saved_groups = list(header["param_groups"])
    for g, group in enumerate(target_names):
        entry = _hyperparams_for(group, saved_groups, mapping, g) if saved_groups else {}
        entry["params"] = list(range(start, start + len(group)))
        start += len(group)
        groups.append(entry)
    return {"state": state, "param_groups": groups}


def load_group_hyperparameters(
    optimizer: Optimizer,
    names: list[list[str]],
    header: Mapping[str, Any],
    mapping: Mapping[str, str],
) -> None:
    """Set each param group's hyper-parameters (learning rate, betas, ...) of ``optimizer`` from
    the saved group holding its parameters; the states are loaded separately (sharded
    optimizers load them piece by piece)."""
    hyper = to_torch_state_dict(names, header, iter(()), mapping)["param_groups"]
    for group, saved in zip(optimizer.param_groups, hyper, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
