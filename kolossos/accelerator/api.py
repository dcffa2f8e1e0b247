"""Choosing the accelerator of this process: :func:`get_accelerator` and :func:`set_accelerator`."""

from __future__ import annotations

import os
import threading

from kolossos.accelerator.base_accelerator import BaseAccelerator
from kolossos.accelerator.cpu_accelerator import CpuAccelerator
from kolossos.accelerator.cuda_accelerator import CudaAccelerator

__all__ = [
    "ACCELERATOR_ENV",
    "ACCELERATOR_TYPES",
    "auto_set_accelerator",
    "get_accelerator",
    "set_accelerator",
]

#: Environment variable that forces the accelerator (``cpu`` or ``cuda``).
ACCELERATOR_ENV = "KOLOSSOS_ACCELERATOR"

#: Accelerator name -> class.
ACCELERATOR_TYPES: dict[str, type[BaseAccelerator]] = {
    "cpu": CpuAccelerator,
    "cuda": CudaAccelerator,
}

_lock = threading.Lock()
_accelerator: BaseAccelerator | None = None


def _build(name: str, origin: str) -> BaseAccelerator:
    """Instantiate the accelerator called ``name``, checking that it can run here."""
    key = name.strip().lower()
    if key not in ACCELERATOR_TYPES:
        raise ValueError(
            f"{origin}={name!r} is not a known accelerator: choose one of "
            f"{sorted(ACCELERATOR_TYPES)}."
        )
    accelerator = ACCELERATOR_TYPES[key]()
    if not accelerator.is_available():
        raise RuntimeError(
            f"{origin}={name!r} was requested but {key} is not available in this process "
            "(torch.cuda.is_available() is False: a CPU-only torch build, no visible GPU, or "
            "CUDA_VISIBLE_DEVICES is empty). Install a CUDA build of torch, or set "
            f"{ACCELERATOR_ENV}=cpu to run on the CPU with gloo."
        )
    return accelerator


def _detect() -> BaseAccelerator:
    """Return the accelerator forced by the environment, else CUDA when available, else CPU."""
    forced = os.environ.get(ACCELERATOR_ENV, "").strip()
    if forced:
        return _build(forced, ACCELERATOR_ENV)
    cuda = CudaAccelerator()
    return cuda if cuda.is_available() else CpuAccelerator()


def get_accelerator() -> BaseAccelerator:
    """Return the accelerator of this process, choosing it on the first call.

    The choice, made once and cached: the value of the environment variable
    ``KOLOSSOS_ACCELERATOR`` (``cpu`` or ``cuda``) when set; otherwise ``cuda`` when
    ``torch.cuda.is_available()``; otherwise ``cpu``.

    Returns:
        The cached :class:`BaseAccelerator`.

    Raises:
        ValueError: ``KOLOSSOS_ACCELERATOR`` names an unknown accelerator.
        RuntimeError: ``KOLOSSOS_ACCELERATOR=cuda`` but CUDA is not available.

    Example:
        >>> from kolossos.accelerator import get_accelerator
        >>> device = get_accelerator().get_current_device()
    """
    global _accelerator
    if _accelerator is None:
        with _lock:
            if _accelerator is None:
                _accelerator = _detect()
    return _accelerator


def set_accelerator(accelerator: str | BaseAccelerator) -> BaseAccelerator:
    """Replace the cached accelerator of this process.

    Call it before any tensor or process group is created: objects made for the previous
    accelerator are not moved.

    Args:
        accelerator: ``"cpu"``, ``"cuda"`` or an instance of a :class:`BaseAccelerator` subclass.

    Returns:
        The accelerator now in use.

    Raises:
        TypeError: ``accelerator`` is neither a name nor an accelerator instance.
        ValueError: an unknown name.
        RuntimeError: ``"cuda"`` was asked for but CUDA is not available.

    Example:
        >>> set_accelerator("cpu")
        CpuAccelerator(name='cpu', backend='gloo')
    """
    global _accelerator
    if isinstance(accelerator, BaseAccelerator):
        chosen = accelerator
    elif isinstance(accelerator, str):
        chosen = _build(accelerator, "accelerator")
    else:
        raise TypeError(
            f"set_accelerator() takes 'cpu', 'cuda' or a BaseAccelerator instance, got "
            f"{type(accelerator).__name__}."
        )
    with _lock:
        _accelerator = chosen
    return chosen


def auto_set_accelerator() -> BaseAccelerator:
    """Forget any previous choice and detect the accelerator again (see :func:`get_accelerator`).

    Returns:
        The accelerator now in use.
    """
    global _accelerator
    with _lock:
        _accelerator = _detect()
        return _accelerator
