"""``init_chunk_manager``: Colossal-AI's one call from a model to its chunk manager."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.accelerator import get_accelerator
from kolossos.zero.gemini.chunk.manager import ChunkManager
from kolossos.zero.gemini.chunk.search import tied_params, unique_params
from kolossos.zero.gemini.chunk.search_utils import flat_chunk_config, search_chunk_configuration

__all__ = ["init_chunk_manager"]

_MI = 1024**2
DEFAULT_SEARCH_INTERVAL = 1024


def init_chunk_manager(
    model: nn.Module,
    init_device: torch.device | str | None = None,
    hidden_dim: int | None = None,
    verbose: bool = False,
    **kwargs: Any,
) -> ChunkManager:
    """Search a chunk size for ``model`` and pack its parameters into chunks of that size.

    The search is :func:`~kolossos.zero.gemini.chunk.search_utils.search_chunk_configuration`
    with ``search_interval=hidden_dim`` (default 1024). The manager packs the parameters in
    registration order (tied parameters once) in their dtype; nothing is allocated or
    communicated until ``GeminiDDP`` fills the chunks, so the parameters are left untouched.

    Args:
        model: the model.
        init_device: the compute device of the chunks (default: the accelerator's current one).
        hidden_dim: the search interval in elements (the model's hidden size is best).
        verbose: print the search's time and waste on rank 0, as Colossal-AI does.
        **kwargs: the other arguments of ``search_chunk_configuration``: ``search_range_m``
            (required), ``min_chunk_size_m``, ``filter_exlarge_params``, ``strict_ddp_flag``,
            ``process_group``, ``memstas``.

    Returns:
        A :class:`~kolossos.zero.gemini.chunk.manager.ChunkManager`; a model smaller than
        ``min_chunk_size_m`` gets one chunk kept gathered.

    Raises:
        ValueError: ``search_interval`` passed (use ``hidden_dim``), or invalid search values.

    Example:
        >>> manager = init_chunk_manager(model, hidden_dim=768, search_range_m=32)
        >>> manager.dp_degree_chunk_size_dict  # doctest: +SKIP
        {2: 33554432}
    """
    if "search_interval" in kwargs:
        raise ValueError(
            f"init_chunk_manager(search_interval={kwargs['search_interval']!r}): the interval "
            "is hidden_dim here; pass hidden_dim= instead."
        )
    begin = time.perf_counter()
    config, total, wasted = search_chunk_configuration(
        model, search_interval=hidden_dim or DEFAULT_SEARCH_INTERVAL, **kwargs
    )
    seconds = time.perf_counter() - begin
    group = kwargs.get("process_group")
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        share = 100 * wasted / (total + wasted) if wasted else 0.0
        print(
            f"searching chunk configuration is completed in {seconds:.2f} s.\n"
            f"used number: {total / _MI:.2f} * 2^20, wasted number: {wasted / _MI:.2f} * 2^20\n"
            f"total wasted percentage is {share:.2f}%",
            flush=True,
        )
    entry = flat_chunk_config(config) if config else {"chunk_size": 1, "keep_gathered": False}
    named = unique_params(model)
    floating = [p.dtype for _, p in named if p.is_floating_point()]
    device = init_device if init_device is not None else get_accelerator().get_current_device()
    manager = ChunkManager(
        named,
        int(entry["chunk_size"]),
        floating[0] if floating else torch.float32,
        group,
        torch.device(device),
        alone=tied_params(model),
    )
    for chunk in manager:
        chunk.keep_gathered = bool(entry.get("keep_gathered", False))
    return manager
