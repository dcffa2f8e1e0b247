"""``Config``: Colossal-AI's configuration, a dict whose keys read as attributes.

A config comes from a dict or from a file (:meth:`Config.from_file`): a Python file whose
module-level names become the keys (Colossal-AI's format), or a JSON, TOML or YAML table.
Nested dicts become ``Config`` objects too, so ``gpc.config.parallel.tensor.size`` works.
"""

from __future__ import annotations

import json
import os
import runpy
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Config", "ConfigException"]

SUFFIXES = (".py", ".json", ".toml", ".yaml", ".yml")


class ConfigException(Exception):
    """A config file could not be read: it raised, or it does not parse."""


class Config(dict[str, Any]):
    """A dict with attribute access; nested dicts are wrapped as ``Config`` as well.

    Args:
        config: the initial keys (a dict or ``None``).

    Raises:
        TypeError: ``config`` is not a mapping.

    Example:
        >>> cfg = Config(dict(parallel=dict(pipeline=2), BATCH_SIZE=8))
        >>> cfg.parallel.pipeline, cfg.BATCH_SIZE
        (2, 8)
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if config is None:
            return
        if not isinstance(config, Mapping):
            raise TypeError(
                f"Config needs a dict, got {type(config).__name__}; pass e.g. "
                "Config(dict(parallel=dict(pipeline=2)))."
            )
        for key, value in config.items():
            self._add_item(key, value)

    def __missing__(self, key: str) -> Any:
        raise KeyError(key)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError:
            raise AttributeError(key) from None

    def _add_item(self, key: str, value: Any) -> None:
        self[key] = Config(value) if isinstance(value, Mapping) else value

    def update(self, config: Mapping[str, Any] | None = None, **kwargs: Any) -> Config:  # type: ignore[override]
        """Add (or replace) keys from a mapping, wrapping nested dicts; returns ``self``.

        Raises:
            TypeError: ``config`` is not a mapping.
        """
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"Config.update needs a dict or Config, got {type(config).__name__}.")
        for key, value in {**(config or {}), **kwargs}.items():
            self._add_item(key, value)
        return self

    @staticmethod
    def from_file(filename: str | os.PathLike[str]) -> Config:
        """Read a config file into a ``Config``.

        A ``.py`` file is run and its module-level names become keys (names starting with
        ``__``, modules and classes are left out, as in Colossal-AI). ``.json``, ``.toml`` and
        ``.yaml``/``.yml`` files must hold a table at the top level (YAML needs PyYAML).

        Args:
            filename: the path of the file.

        Raises:
            TypeError: ``filename`` is not a str or path.
            FileNotFoundError: no such file.
            ValueError: an unsupported suffix.
            ConfigException: the file raised while running, or does not parse, or its top
                level is not a table.

        Example:
            >>> Config.from_file("configs/vit_1d.py").parallel.tensor.mode  # doctest: +SKIP
            '1d'
        """
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(
                f"Config.from_file needs a path (str or pathlib.Path), got "
                f"{type(filename).__name__}."
            )
        path = Path(filename).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {str(filename)!r} does not exist (resolved to {path.absolute()}); "
                "check the path."
            )
        if path.suffix.lower() not in SUFFIXES:
            raise ValueError(
                f"config file {str(filename)!r}: the suffix {path.suffix!r} is not supported; "
                f"use one of {', '.join(SUFFIXES)}."
            )
        raw = _READERS[path.suffix.lower()](path)
        if not isinstance(raw, Mapping):
            raise ConfigException(
                f"config file {str(filename)!r}: the top level must be a table of keys, got "
                f"{type(raw).__name__}."
            )
        return Config(raw)


def _read_python(path: Path) -> dict[str, Any]:
    try:
        namespace = runpy.run_path(str(path), run_name=f"__kolossos_config_{path.stem}__")
    except Exception as exc:  # the user's code: any error is reported as a config error
        raise ConfigException(
            f"running the config file {str(path)!r} raised {type(exc).__name__}: {exc}; fix "
            "the file (it is executed as Python)."
        ) from exc
    return {
        key: value
        for key, value in namespace.items()
        if not key.startswith("__") and not isinstance(value, (types.ModuleType, type))
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigException(f"config file {str(path)!r} is not valid JSON: {exc}.") from None


def _read_toml(path: Path) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigException(
                f"reading the TOML config file {str(path)!r} on Python 3.10 needs tomli; pip "
                "install tomli, or write the config as a .py or .json file."
            ) from None
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigException(f"config file {str(path)!r} is not valid TOML: {exc}.") from None


def _read_yaml(path: Path) -> Any:
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigException(
            f"reading the YAML config file {str(path)!r} needs PyYAML; pip install pyyaml, or "
            "write the config as a .py, .json or .toml file."
        ) from None
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigException(f"config file {str(path)!r} is not valid YAML: {exc}.") from None


_READERS = {
    ".py": _read_python,
    ".json": _read_json,
    ".toml": _read_toml,
    ".yaml": _read_yaml,
    ".yml": _read_yaml,
}
