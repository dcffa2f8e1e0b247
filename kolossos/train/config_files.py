"""Read a config file (Python, TOML, YAML or JSON) and ``key=value`` overrides into a config.

Python config files are written like Colossal-AI's: plain variables at module level. Lower-case
names are configuration keys; UPPER-CASE names are free hyper-parameters you can reuse in the
file (they are not keys); names starting with ``_``, modules, functions and classes are ignored::

    BATCH = 32                                   # a free hyper-parameter
    name = "my-run"
    plugin = "torch_ddp"
    model = dict(n_layer=4, n_head=4, n_embd=128)
    train = dict(steps=400, batch_size=BATCH)

Overrides use dotted keys and Python/TOML-like literals: ``train.steps=100``,
``plugin_kwargs.bucket_cap_mb=10``, ``data.path=~/corpus.txt`` (a bare word is a string).
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kolossos.train.config import TrainConfig
from kolossos.train.errors import ConfigError
from kolossos.train.schema import (
    FREE_TABLES,
    SECTIONS,
    all_keys,
    config_from_dict,
    top_level_keys,
)

__all__ = ["SUFFIXES", "apply_overrides", "load_config", "parse_override", "read_config_file"]

SUFFIXES = (".py", ".toml", ".yaml", ".yml", ".json")
_WORDS = {"true": True, "false": False, "none": None, "null": None}


def _read_python(path: Path) -> dict[str, Any]:
    try:
        namespace = runpy.run_path(str(path), run_name="__kolossos_config__")
    except Exception as exc:  # the user's code: report any error as a config error
        raise ConfigError(
            "", problem=f"running the Python config file raised {type(exc).__name__}: {exc}."
        ) from exc
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_")
        and not name.isupper()
        and not isinstance(value, (types.ModuleType, types.FunctionType, type))
    }


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(
                "",
                problem="reading TOML on Python 3.10 needs the 'tomli' package.",
                hint="pip install tomli, or use a .py, .json or .yaml config file.",
            ) from None
    try:
        with path.open("rb") as fh:
            return dict(tomllib.load(fh))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", problem=f"the file is not valid TOML: {exc}.") from None


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError(
            "",
            problem="reading YAML needs the 'PyYAML' package.",
            hint="pip install pyyaml, or use a .py, .toml or .json config file.",
        ) from None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("", problem=f"the file is not valid YAML: {exc}.") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError("", problem=f"the file is not valid JSON: {exc}.") from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw top-level mapping of a config file (not validated yet).

    Raises:
        ConfigError: a missing file, an unsupported suffix, or a file that does not parse.
    """
    file = Path(path).expanduser()
    source = str(path)
    if file.suffix not in SUFFIXES:
        raise ConfigError(
            "CONFIG",
            source,
            "files ending in " + ", ".join(SUFFIXES),
            hint="Rename the file or convert it.",
        )
    if not file.is_file():
        raise ConfigError(
            "CONFIG",
            source,
            problem=f"the config file {source!r} does not exist (looked in {os.getcwd()}).",
            hint="Pass the path of a config file, or no path to train the built-in default.",
        )
    readers = {".py": _read_python, ".toml": _read_toml, ".json": _read_json}
    try:
        raw = readers.get(file.suffix, _read_yaml)(file)
    except ConfigError as exc:
        raise exc.with_source(source) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            "CONFIG",
            problem="the top level of a config file must be a table of keys.",
            source=source,
        )
    return raw


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into ``(["a", "b"], value)``.

    The value is a Python literal (``10``, ``3e-4``, ``True``, ``None``, ``'text'``, ``[1, 2]``,
    ``{'k': 1}``), ``true``/``false``/``null``, or else the text itself.

    Raises:
        ConfigError: no ``=``, or an empty key part.

    Example:
        >>> parse_override("train.lr=3e-4")
        (['train', 'lr'], 0.0003)
    """
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(
            "",
            problem=f"the override {text!r} is not of the form key=value.",
            hint="Write e.g. train.steps=100 or model.n_layer=2.",
            source="command line",
        )
    value = value.strip()
    if value.lower() in _WORDS:
        return [p.strip() for p in parts], _WORDS[value.lower()]
    try:
        parsed: Any = ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        parsed = value
    return [p.strip() for p in parts], parsed


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        from kolossos.train.schema import section_keys

        return {key: getattr(value, f) for key, f in section_keys(type(value)).items()}
    return {}


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return ``raw`` with each ``key=value`` of ``overrides`` applied (later ones win).

    Raises:
        ConfigError: a malformed override, or a dotted key below a plain value.
    """
    result = dict(raw)
    for text in overrides:
        parts, value = parse_override(text)
        top = parts[0]
        if len(parts) == 1:
            result[top] = value
            continue
        if top not in SECTIONS and top not in FREE_TABLES:
            raise ConfigError.unknown_key(
                ".".join(parts), top_level_keys(), source="command line", everywhere=all_keys()
            )
        node = _as_dict(result.get(top, {}))
        result[top] = node
        for part in parts[1:-1]:  # deeper tables inside plugin_kwargs
            node[part] = _as_dict(node.get(part, {}))
            node = node[part]
        node[parts[-1]] = value
    return result


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> TrainConfig:
    """Read ``path`` (``None``: the built-in default), apply ``overrides``, validate.

    Raises:
        ConfigError: anything wrong, in one paragraph naming the key, the value and what is
            allowed.

    Example:
        >>> load_config(None, ["train.steps=50"]).train.steps
        50
    """
    raw = {} if path is None else read_config_file(path)
    source = "built-in default" if path is None else str(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
        source += " + command-line overrides"
    return config_from_dict(raw, source=source)
