"""The trainer's own files in a checkpoint, checked before anything is restored.

The RNG states a checkpoint keeps per rank (``rng/rank_NNNNN.pt``):
:func:`~kolossos.train.checkpoints.capture_rng` writes a dict::

    "torch"        torch.get_rng_state(): a 1-D uint8 tensor (5056 bytes for the CPU generator)
    "python"       random.getstate(): (version, 625 ints, gauss or None)
    "numpy"        (when numpy is installed) ("MT19937", 624 keys as an int64 tensor, pos,
                   has_gauss, cached_gaussian)
    "accelerator"  (off CPU) the device generator's state: a 1-D uint8 tensor

:func:`rng_state_problem` checks that structure and dtypes, then sets each state on a scratch
generator (never the process's own), so a damaged state is refused before anything is restored.
The JSON files (trainer state, tokenizer) are read by :mod:`kolossos.train.state_files`;
:func:`agree_on_error` lets every rank stop together when one rank's file is bad.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kolossos.accelerator import get_accelerator
from kolossos.checkpoint_io import CheckpointError
from kolossos.checkpoint_io.backends import read_object_file
from kolossos.train.state_files import CheckpointFileError

__all__ = ["agree_on_error", "read_rng_file", "rng_state_problem"]

_KEYS = ("torch", "python", "numpy", "accelerator")
_MT_WORDS = 624  # Mersenne Twister state words (python's state adds the position: 625)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _byte_tensor_problem(value: Any, length: int | None) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"must be a uint8 tensor, found a {type(value).__name__}"
    if value.dtype != torch.uint8 or value.dim() != 1:
        return (
            f"must be a 1-D uint8 tensor, found a {value.dtype} tensor of shape {list(value.shape)}"
        )
    if length is not None and value.numel() != length:
        return f"must have {length} bytes (this generator's state size), found {value.numel()}"
    return None


def _torch_problem(value: Any) -> str | None:
    problem = _byte_tensor_problem(value, torch.get_rng_state().numel())
    if problem is None:
        try:
            torch.Generator().set_state(value)
        except RuntimeError as exc:
            problem = f"is not a valid generator state: {exc}"
    return problem


def _python_problem(value: Any) -> str | None:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        return "must be random.getstate()'s (version, internal state, gauss) triple"
    version, internal, gauss = value
    if not isinstance(internal, (tuple, list)) or len(internal) != _MT_WORDS + 1:
        return f"must hold {_MT_WORDS + 1} integers as its internal state"
    if not _is_int(version) or not all(_is_int(x) for x in internal):
        return "must hold integers only (version and internal state)"
    if gauss is not None and not isinstance(gauss, float):
        return f"must end with None or a float, found a {type(gauss).__name__}"
    try:
        random.Random().setstate((version, tuple(internal), gauss))
    except (ValueError, TypeError, OverflowError) as exc:
        return f"is not a valid state of python's random module: {exc}"
    return None


def _numpy_problem(value: Any) -> str | None:
    if not isinstance(value, (tuple, list)) or len(value) != 5:
        return "must be the 5-tuple (kind, keys, pos, has_gauss, cached_gaussian)"
    kind, keys, pos, has_gauss, cached = value
    if kind != "MT19937":
        return f"must be an 'MT19937' state, found kind {kind!r}"
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        return "must hold its keys as a 1-D int64 tensor"
    if keys.numel() != _MT_WORDS or bool((keys < 0).any()) or bool((keys >= 2**32).any()):
        return f"must hold {_MT_WORDS} keys in [0, 2**32)"
    if not (_is_int(pos) and _is_int(has_gauss) and isinstance(cached, (int, float))):
        return "must have integers pos and has_gauss and a number cached_gaussian"
    try:
        import numpy as np
    except ImportError:
        return None  # without numpy there is no numpy generator to restore (restore_rng skips it)
    legacy = (kind, keys.numpy().astype("uint32"), pos, has_gauss, float(cached))
    try:
        np.random.RandomState().set_state(legacy)
    except (ValueError, TypeError) as exc:
        return f"is not a valid numpy random state: {exc}"
    return None


def _accelerator_problem(value: Any) -> str | None:
    accelerator = get_accelerator()
    if accelerator.name == "cpu":  # saved on a device this process does not have: not restored
        return _byte_tensor_problem(value, None)
    return _byte_tensor_problem(value, accelerator.get_rng_state().numel())


_CHECKS = {
    "torch": _torch_problem,
    "python": _python_problem,
    "numpy": _numpy_problem,
    "accelerator": _accelerator_problem,
}


def rng_state_problem(state: Any, rank: int | None = None) -> str | None:
    """What makes ``state`` unfit for :func:`~kolossos.train.checkpoints.restore_rng`.

    Args:
        state: a loaded RNG state.
        rank: the rank it belongs to (named in the message).

    Returns:
        ``None`` when it can be restored, else one sentence, e.g. ``"RNG state of rank 1 lacks
        'torch' (it has ['python'])"``.
    """
    who = "RNG state" if rank is None else f"RNG state of rank {rank}"
    if not isinstance(state, dict):
        return f"{who} must be the dict capture_rng writes, found a {type(state).__name__}"
    unknown = sorted(str(k) for k in state if k not in _KEYS)
    if unknown:
        return f"{who} has unknown entries {unknown} (capture_rng writes {list(_KEYS)})"
    for key in ("torch", "python"):
        if key not in state:
            return f"{who} lacks {key!r} (it has {sorted(state)})"
    for key, check in _CHECKS.items():
        problem = check(state[key]) if key in state else None
        if problem is not None:
            return f"{who}: {key!r} {problem}"
    return None


def read_rng_file(path: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """Read and check the RNG file of ``rank`` (safely: ``torch.load(weights_only=True)``).

    Raises:
        CheckpointFileError: the file is missing, truncated, corrupt, pickles Python objects, or
            does not hold a valid RNG state (the message names the file and the problem).
    """
    file = Path(path)
    try:
        state = read_object_file(file)
    except CheckpointError as exc:
        raise CheckpointFileError(file, str(exc)) from exc
    problem = rng_state_problem(state, rank)
    if problem is not None:
        raise CheckpointFileError(file, problem)
    return state


def agree_on_error(error: Exception | None) -> None:
    """Raise ``error``, or the first other rank's, on every rank (a collective when several
    processes run; call it on all of them at the same point).

    So a file only one rank reads (its RNG state) stops every rank before the next collective,
    instead of leaving the others waiting for it.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, error)  # SYNC POINT
        error = error or next((e for e in found if e is not None), None)
    if error is not None:
        raise error
