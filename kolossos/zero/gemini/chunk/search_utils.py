"""Colossal-AI's chunk search, ``search_chunk_configuration``: its signature, rule and result.

``GeminiDDP`` runs kolossos' own search (:func:`~kolossos.zero.gemini.chunk.search.
find_chunk_configuration`); this module gives scripts written for Colossal-AI its function,
which picks a chunk size by a slightly different rule:

* parameters are grouped by data-parallel degree (in kolossos every parameter is replicated
  over the group, so there is one group, keyed by the group's size); a group smaller than
  ``min_chunk_size_m`` becomes one chunk kept gathered (``keep_gathered=True``);
* with ``filter_exlarge_params``, parameters larger than mean + 3 standard deviations of all
  parameter sizes are left out of the search (they get chunks of their own);
* candidates run from the largest remaining parameter (at least ``min_chunk_size_m``), rounded
  up to ``search_interval``, for ``search_range_m`` more, every ``search_interval`` elements;
* a candidate's waste counts the room left when a parameter opens a new chunk *and* the room
  left in the last chunk; the first (smallest) least-wasting size wins, rounded up to a
  multiple of every group's degree.

It returns ``(config_dict, total_param_size, min_chunk_waste)``, ``config_dict`` keyed by
data-parallel degree: ``{N: {"chunk_size": elements, "keep_gathered": bool}}``. kolossos'
``GeminiDDP`` and ``GeminiPlugin`` take one entry, ``chunk_config_dict=config_dict[N]``
(:func:`flat_chunk_config` picks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["classify_params_by_dp_degree", "flat_chunk_config", "search_chunk_configuration"]

_MI = 1024**2


def _group_size(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(process_group) if dist.is_initialized() else 1


def classify_params_by_dp_degree(
    param_order: Iterable[torch.Tensor], process_group: dist.ProcessGroup | None = None
) -> dict[int, list[torch.Tensor]]:
    """Group parameters by the data-parallel degree they are sharded over.

    In kolossos every parameter a Gemini model chunks is replicated over the data-parallel
    group, so the result has one key, the group's size (1 without a process group).

    Args:
        param_order: the parameters in the order chunks are packed (each once); an object with
            a ``generate()`` method (Colossal-AI's ``OrderedParamGenerator``) is read through it.
        process_group: the data-parallel group (default: all ranks).

    Returns:
        ``{degree: [parameters in order]}`` (empty without parameters).
    """
    generate = getattr(param_order, "generate", None)
    params = list(generate() if callable(generate) else param_order)
    return {_group_size(process_group): params} if params else {}


def _check(search_range_m: float, search_interval: int, min_chunk_size_m: float) -> None:
    for name, value in (("search_range_m", search_range_m), ("min_chunk_size_m", min_chunk_size_m)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(
                f"{name}={value!r} must be a number >= 0 of Mi-elements (2**20), e.g. 32."
            )
    if isinstance(search_interval, bool) or not isinstance(search_interval, int):
        raise TypeError(
            f"search_interval={search_interval!r} must be an int (elements between candidate "
            "chunk sizes; the model's hidden size is a good value)."
        )
    if search_interval <= 0:
        raise ValueError(f"search_interval={search_interval} must be > 0, e.g. 1024.")


def _unused(numels: list[int], sizes: torch.Tensor) -> torch.Tensor:
    """Per candidate size: the room left when a parameter opens a new chunk, plus the room
    left in the last chunk (every parameter fits: sizes are at least the largest one)."""
    left = torch.zeros_like(sizes)
    acc = torch.zeros_like(sizes)
    for n in numels:
        opened = left < n
        acc += torch.where(opened, left, 0)
        left = torch.where(opened, sizes, left) - n
    return acc + left


def _drop_exlarge(size_dict: dict[int, list[int]]) -> None:
    """Drop sizes above mean + 3 standard deviations (population) of all sizes, in place."""
    every = [n for sizes in size_dict.values() for n in sizes]
    if not every:
        return
    values = torch.tensor(every, dtype=torch.float64)
    limit = float(values.mean() + 3 * values.std(unbiased=False))
    for key, sizes in size_dict.items():
        size_dict[key] = [n for n in sizes if n <= limit]


def search_chunk_configuration(
    model: nn.Module,
    search_range_m: float,
    search_interval: int,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    strict_ddp_flag: bool = False,
    process_group: dist.ProcessGroup | None = None,
    memstas: Any = None,
) -> tuple[dict[int, dict[str, Any]], int, int]:
    """Colossal-AI's chunk-size search (the rule is in the module docstring).

    Args:
        model: the model (parameters may be on the meta device); tied parameters count once.
        search_range_m: width of the searched range, in Mi-elements (2**20).
        search_interval: step between candidate sizes, in elements (the hidden size is best).
        min_chunk_size_m: smallest chunk, in Mi-elements; a smaller model is one kept-gathered
            chunk.
        filter_exlarge_params: leave parameters above mean + 3 std out of the search.
        strict_ddp_flag: Colossal-AI's "every parameter replicated" mode. kolossos' Gemini only
            chunks replicated parameters, so the result is the same either way (as in
            Colossal-AI 0.3.2+, whose search does not read the flag either).
        process_group: the data-parallel group (its size is the degree; default: all ranks).
        memstas: not supported (must be ``None``): kolossos' ``MemStats`` records chunk
            access order, not parameter order; the search uses registration order.

    Returns:
        ``(config_dict, total_param_size, min_chunk_waste)``: ``{degree: {"chunk_size":
        elements, "keep_gathered": bool}}``, the number of parameter elements, and the
        elements the chosen size wastes.

    Raises:
        ValueError, TypeError: a negative range or size, a non-positive or non-int interval.
        NotImplementedError: ``memstas`` given.

    Example:
        >>> config, total, waste = search_chunk_configuration(model, 1, 128, min_chunk_size_m=0)
        >>> config  # doctest: +SKIP
        {1: {'chunk_size': 527872, 'keep_gathered': False}}
    """
    _check(search_range_m, search_interval, min_chunk_size_m)
    if not isinstance(strict_ddp_flag, bool) or not isinstance(filter_exlarge_params, bool):
        raise TypeError(
            f"strict_ddp_flag={strict_ddp_flag!r} and filter_exlarge_params="
            f"{filter_exlarge_params!r} must be True or False."
        )
    if memstas is not None:
        raise NotImplementedError(
            "search_chunk_configuration(memstas=...) is not supported: kolossos' MemStats "
            "records chunk access order, not parameter order. Pass memstas=None (registration "
            "order), or give placement_policy='auto' the MemStats instead."
        )
    search_range = round(search_range_m * _MI)
    min_chunk_size = round(min_chunk_size_m * _MI)
    params_dict = classify_params_by_dp_degree(model.parameters(), process_group)
    config: dict[int, dict[str, Any]] = {}
    size_dict: dict[int, list[int]] = {}
    total = 0
    for degree, params in params_dict.items():
        sizes = [p.numel() for p in params]
        total += sum(sizes)
        if sum(sizes) < min_chunk_size:  # small: one chunk, kept gathered
            config[degree] = {"chunk_size": sum(sizes), "keep_gathered": True}
        else:
            size_dict[degree] = sizes
    if filter_exlarge_params:
        _drop_exlarge(size_dict)
    largest = max([min_chunk_size, *(max(s) for s in size_dict.values() if s)])
    start = math.ceil(largest / search_interval) * search_interval
    candidates = torch.arange(start, start + search_range + 1, search_interval, dtype=torch.int64)
    waste = torch.zeros_like(candidates)
    for sizes in size_dict.values():
        waste += _unused(sizes, candidates)
    best = int(torch.argmin(waste))  # the first minimum: the smallest size
    degrees = math.lcm(*params_dict) if params_dict else 1
    chunk_size = int(candidates[best]) + (-int(candidates[best]) % degrees)
    for degree in params_dict:
        config.setdefault(degree, {"chunk_size": chunk_size, "keep_gathered": False})
    return config, total, int(waste[best])


def flat_chunk_config(config: Mapping[Any, Any], world_size: int | None = None) -> dict[str, Any]:
    """The ``{"chunk_size": ..., "keep_gathered": ...}`` part of a chunk configuration.

    Accepts kolossos' flat form and Colossal-AI's form keyed by data-parallel degree (what
    :func:`search_chunk_configuration` returns), which must then have one key, equal to
    ``world_size`` when that is given. Values are not validated here.

    Raises:
        TypeError: ``config`` is not a dict.
        ValueError: a keyed form with several degrees, or with another degree than
            ``world_size``.
    """
    if not isinstance(config, Mapping):
        raise TypeError(
            f"chunk_config_dict must be a dict (from search_chunk_configuration), got "
            f"{type(config).__name__}."
        )
    keyed = [k for k in config if isinstance(k, int) and not isinstance(k, bool)]
    if not keyed:
        return dict(config)
    if len(config) != 1 or not isinstance(config[keyed[0]], Mapping):
        raise ValueError(
            f"chunk_config_dict={dict(config)!r}: a configuration keyed by data-parallel degree "
            "must have exactly one entry {degree: {'chunk_size': ..., 'keep_gathered': ...}} "
            "(kolossos' Gemini chunks every parameter over one group)."
        )
    degree = keyed[0]
    if world_size is not None and degree != world_size:
        raise ValueError(
            f"chunk_config_dict is keyed by data-parallel degree {degree}, but the group has "
            f"{world_size} ranks; search the configuration with this group "
            "(search_chunk_configuration(..., process_group=group)) or pass "
            "{'chunk_size': elements}."
        )
    return dict(config[degree])
