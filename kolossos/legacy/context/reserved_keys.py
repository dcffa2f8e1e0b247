"""The keys a legacy config may hold (CHECKLIST §3.2) and the check of a whole config.

Reserved (lower-case) keys are features ``launch``/``initialize`` read; UPPER-CASE names are free
hyper-parameters (``gpc.config.BATCH_SIZE``); any other lower-case key is most likely a typo
and gets one warning naming it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["RESERVED_KEYS", "check_config_keys"]

_NUMBER = (int, float)

#: reserved key -> (accepted types, what it means)
RESERVED_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "parallel": ((Mapping,), "process-group layout: dict(data, pipeline, tensor=dict(...))"),
    "fp16": ((Mapping,), "mixed precision: dict(mode=AMP_TYPE..., **kwargs)"),
    "zero": ((Mapping,), "ZeRO: dict(stage=1|2|3, model_config=..., optimizer_config=...)"),
    "gradient_accumulation": ((int,), "accumulate gradients over N iterations"),
    "clip_grad_norm": (_NUMBER, "clip the global gradient norm to this value"),
    "gradient_handler": ((list, tuple), "[dict(type='HandlerName', **kwargs)]"),
    "gradient_handlers": ((list, tuple), "[dict(type='HandlerName', **kwargs)]"),
    "dali": ((Mapping,), "DALI data-loading options"),
    "cudnn_benchmark": ((bool,), "torch.backends.cudnn.benchmark"),
    "cudnn_deterministic": ((bool,), "torch.backends.cudnn.deterministic"),
    "torch_ddp": ((Mapping,), "keyword arguments of DistributedDataParallel"),
    "model": ((Mapping,), "model options, e.g. dict(num_chunks=2) for interleaved pipelines"),
    "amp": ((Mapping,), "mixed-precision options (older spelling of fp16)"),
    "seed": ((int,), "the random seed"),
}


def _type_names(types_: tuple[type, ...]) -> str:
    names = " or ".join("dict" if t is Mapping else t.__name__ for t in types_)
    return ("an " if names[0] in "aeiou" else "a ") + names


def check_config_keys(config: Mapping[str, Any]) -> list[str]:
    """Check the types of the reserved keys and warn once about each unknown lower-case key.

    Returns:
        The unknown keys (each was warned about).

    Raises:
        TypeError: a reserved key holds a value of the wrong type.
        ValueError: ``gradient_accumulation`` < 1 or ``clip_grad_norm`` < 0.
    """
    for key in config:
        if not isinstance(key, str):
            raise TypeError(f"config key {key!r} must be a string.")
    check_reserved_keys(config)
    unknown = []
    for key in config:
        if key not in RESERVED_KEYS and not key.isupper() and not key.startswith("_"):
            unknown.append(key)
            known = ", ".join(sorted(RESERVED_KEYS))
            warnings.warn(
                f"config key {key!r} is not a reserved key and not an UPPER-CASE "
                f"hyper-parameter, so nothing reads it; reserved keys are: {known}. Rename it "
                "in upper case if it is your own setting.",
                UserWarning,
                stacklevel=3,
            )
    return unknown


def check_reserved_keys(config: Mapping[str, Any]) -> None:
    """Check the types of the reserved keys only (no warnings about other keys).

    Raises:
        TypeError / ValueError: as :func:`check_config_keys`.
    """
    for key, value in config.items():
        if key in RESERVED_KEYS:
            _check_reserved(key, value)


def _check_reserved(key: str, value: Any) -> None:
    types_, meaning = RESERVED_KEYS[key]
    if value is None and key in ("fp16", "zero", "amp", "clip_grad_norm"):
        return  # explicitly switched off
    if (isinstance(value, bool) and bool not in types_) or not isinstance(value, types_):
        raise TypeError(f"config key {key}={value!r} must be {_type_names(types_)} ({meaning}).")
    number: Any = value
    if key == "gradient_accumulation" and number < 1:
        raise ValueError(f"config key gradient_accumulation={value} must be >= 1.")
    if key == "clip_grad_norm" and number < 0:
        raise ValueError(f"config key clip_grad_norm={value} must be >= 0 (0 switches it off).")
