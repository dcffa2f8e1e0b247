"""``kolossos serve CONFIG.py``: Energon-AI's ``opt_config.py`` keys mapped onto the server options.

The file is Python, run like every kolossos Python config (``runpy.run_path`` under a private
module name, nothing added to ``sys.modules``, any error it raises reported as a config error
naming the file); its module-level names are the keys (names starting with ``_``, modules and
callables such as functions and classes are left out). Energon-AI writes
``model_class = opt_125M`` with the name imported from ``energonai.model``; here the Energon
model names are predefined as strings, so that line runs unchanged (drop the ``energonai``
imports). Example::

    model_class = opt_125M            # or "OPTForCausalLM", "opt"; must match the checkpoint
    checkpoint = "./opt-125m"         # a save_pretrained folder; relative to this file
    tp_init_size = 2                  # tensor-parallel processes per stage (kolossos: --tp)
    executor_max_batch_size = 16
    cache_size = 50
    cache_list_size = 2
"""

from __future__ import annotations

import json
import runpy
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENERGON_MODELS", "KEYS", "ServeConfigError", "read_serve_config"]

ENERGON_MODELS = {
    **{name: "opt" for name in ("opt_125M", "opt_6B", "opt_30B", "opt_66B", "opt_175B")},
    **{name: "gpt2" for name in ("gpt2_small", "gpt2_large", "gpt2_8B")},
    **{name: "llama" for name in ("llama_7B", "llama_13B", "llama_30B", "llama_65B")},
}
"""Energon-AI model names a config may use bare, and the family each names (the size comes
from the checkpoint's ``config.json``)."""

_FAMILIES = {
    "opt": "opt",
    "optforcausallm": "opt",
    "gpt2": "gpt2",
    "gpt2lmheadmodel": "gpt2",
    "llama": "llama",
    "llamaforcausallm": "llama",
}


def _int(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _text(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


@dataclass(frozen=True)
class _Key:
    option: str
    """The ``kolossos serve`` option (``args`` attribute) the key sets."""
    check: Callable[[Any], bool]
    rule: str


KEYS: dict[str, _Key] = {
    "model_class": _Key("model_class", _text, "a model family: an Energon name (opt_125M), a "
                        "transformers class (OPTForCausalLM) or gpt2 / opt / llama"),
    "checkpoint": _Key("model_dir", _text, "a save_pretrained folder (a str path)"),
    "tokenizer_path": _Key("tokenizer", _text, "a local tokenizer folder (a str path)"),
    "tp_init_size": _Key("tp", _int(1), "an int >= 1"),
    "pp_init_size": _Key("pp", _int(1), "an int >= 1"),
    "host": _Key("host", _text, "a host name or address (a str)"),
    "port": _Key("port", lambda v: _int(1)(v) and v < 65536, "an int port, 1 to 65535"),
    "executor_max_batch_size": _Key("executor_max_batch_size", _int(1), "an int >= 1"),
    "cache_size": _Key("cache_size", _int(0), "an int >= 0 (0 turns the cache off)"),
    "cache_list_size": _Key("cache_list_size", _int(1), "an int >= 1"),
    "batching": _Key("batching", lambda v: v in ("continuous", "static"),
                     "'continuous' or 'static'"),
    "timeout": _Key("timeout", lambda v: isinstance(v, int | float) and not isinstance(v, bool)
                    and v > 0, "seconds > 0"),
    "model_name": _Key("model_name", _text, "a str"),
}  # fmt: skip
"""The keys a serve config may hold, each with the option it sets and its rule."""

REQUIRED = ("model_class", "checkpoint")
_ENERGON_ONLY = {
    "half": "kolossos serves the dtype saved in the checkpoint; save it in half precision",
    "backend": "the backend follows the device (gloo on CPU, NCCL on GPUs)",
    "engine_server": "kolossos serve is the server",
    "model_type": "model_class names the family",
}


class ServeConfigError(ValueError):
    """A serve config that cannot be used; the message names the file and the key."""


def _run(path: Path) -> dict[str, Any]:
    try:
        namespace = runpy.run_path(
            str(path), init_globals={name: name for name in ENERGON_MODELS},
            run_name=f"__kolossos_serve_config_{path.stem}__",
        )  # fmt: skip
    except ModuleNotFoundError as exc:
        raise ServeConfigError(
            f"{path}: importing {exc.name!r} failed; a kolossos serve config needs no imports "
            "(Energon-AI model names such as opt_125M are predefined): remove the import."
        ) from exc
    except Exception as exc:  # the user's code: any error is a config error
        raise ServeConfigError(
            f"{path}: running the config file raised {type(exc).__name__}: {exc}; fix the file "
            "(it is executed as Python)."
        ) from exc
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and not callable(value)  # functions, classes
        and not (name in ENERGON_MODELS and value == name)  # a predefined name, unchanged
    }


def _family_of(folder: Path) -> str | None:
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None  # the server's own folder check reports it
    return _FAMILIES.get(str(model_type).lower())


def read_serve_config(path: str | Path) -> dict[str, Any]:
    """Read a serve config into ``{option: value}`` for the ``kolossos serve`` options.

    Args:
        path: the ``.py`` config file.

    Returns:
        The options the file sets (``model_dir`` always; paths resolved against the file's
        folder).

    Raises:
        ServeConfigError: the file raises, a key is unknown or missing, a value breaks its
            rule, or ``model_class`` names another family than the checkpoint's.
    """
    file = Path(path)
    raw = _run(file)
    for key in raw:
        if key in _ENERGON_ONLY:
            raise ServeConfigError(
                f"{file}: the Energon-AI key {key!r} is not supported by kolossos serve "
                f"({_ENERGON_ONLY[key]}); remove it."
            )
        if key not in KEYS:
            raise ServeConfigError(
                f"{file}: unknown key {key!r}; the keys are {', '.join(KEYS)} (names starting "
                "with _ are free variables)."
            )
    for key in REQUIRED:
        if key not in raw:
            raise ServeConfigError(
                f"{file}: the key {key!r} is missing; set it ({KEYS[key].rule})."
            )
    for key, value in raw.items():
        if not KEYS[key].check(value):
            raise ServeConfigError(f"{file}: {key} = {value!r} must be {KEYS[key].rule}.")
    options = {KEYS[key].option: value for key, value in raw.items()}
    for option in ("model_dir", "tokenizer"):
        if option in options:
            options[option] = str((file.parent / Path(options[option]).expanduser()).resolve())
    wanted = ENERGON_MODELS.get(raw["model_class"]) or _FAMILIES.get(raw["model_class"].lower())
    if wanted is None:
        raise ServeConfigError(
            f"{file}: model_class = {raw['model_class']!r} must be {KEYS['model_class'].rule}; "
            f"Energon names: {', '.join(ENERGON_MODELS)}."
        )
    found = _family_of(Path(options["model_dir"]))
    if found is not None and found != wanted:
        raise ServeConfigError(
            f"{file}: model_class = {raw['model_class']!r} names the family {wanted!r} but "
            f"the checkpoint {raw['checkpoint']!r} holds a {found!r} model; fix one of them."
        )
    del options["model_class"]
    return options
