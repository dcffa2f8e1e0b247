"""Raw mappings (from a config file and overrides) to a :class:`TrainConfig`, and back.

Unknown keys are errors with a "did you mean"; values are checked by the sections themselves.
"""

from __future__ import annotations

import dataclasses
import keyword
from collections.abc import Mapping
from typing import Any

from kolossos.train.config import (
    CheckpointSection,
    DataSection,
    MetricsSection,
    ModelSection,
    SampleSection,
    TrainConfig,
    TrainSection,
)
from kolossos.train.errors import ConfigError

__all__ = [
    "SECTIONS",
    "all_keys",
    "config_from_dict",
    "config_to_dict",
    "section_keys",
    "top_level_keys",
]

#: section name -> its dataclass
SECTIONS: dict[str, type[Any]] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "checkpoint": CheckpointSection,
    "sample": SampleSection,
    "metrics": MetricsSection,
}
#: top-level keys whose values are free-form tables (their inner keys are not schema keys)
FREE_TABLES = ("plugin_kwargs",)


def top_level_keys() -> list[str]:
    """The keys a config file may set at its top level, in schema order."""
    return [f.name for f in dataclasses.fields(TrainConfig)]


def section_keys(cls: type[Any]) -> dict[str, str]:
    """A section's keys in config files, each with its dataclass field. A field named after a
    Python keyword carries a trailing ``_`` (``async_``); its key does not (``async``)."""
    out = {}
    for f in dataclasses.fields(cls):
        bare = f.name.removesuffix("_")
        out[bare if f.name != bare and keyword.iskeyword(bare) else f.name] = f.name
    return out


def all_keys() -> list[str]:
    """Every valid dotted key (``name``, ``model.n_layer``, ...), for suggestions and docs."""
    keys: list[str] = []
    for top in top_level_keys():
        if top in SECTIONS:
            keys += [f"{top}.{key}" for key in section_keys(SECTIONS[top])]
        else:
            keys.append(top)
    return keys


def _section(name: str, raw: Any, source: str) -> Any:
    cls = SECTIONS[name]
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(
            name,
            raw,
            f"a table of {name}.* keys, e.g. {name} = dict(...) in Python or [{name}] in TOML",
            source=source,
        )
    fields = section_keys(cls)
    known = list(fields)
    for key in raw:
        if key not in known:
            raise ConfigError.unknown_key(
                f"{name}.{key}", known, section=name, source=source, everywhere=all_keys()
            )
    try:
        return cls(**{fields[key]: value for key, value in raw.items()})
    except ConfigError as exc:
        raise exc.prefixed(name).with_source(source) from None


def config_from_dict(raw: Mapping[str, Any], source: str = "") -> TrainConfig:
    """Validate a nested mapping into a :class:`TrainConfig` (missing keys keep defaults).

    Args:
        raw: top-level keys; sections as mappings (or section objects).
        source: where the values came from, quoted in error messages.

    Raises:
        ConfigError: an unknown key (with a suggestion) or a value that is not allowed.

    Example:
        >>> config_from_dict({"train": {"steps": 10}}).train.steps
        10
    """
    known = top_level_keys()
    for key in raw:
        if key not in known:
            raise ConfigError.unknown_key(key, known, source=source, everywhere=all_keys())
    values = {
        key: _section(key, value, source) if key in SECTIONS else value
        for key, value in raw.items()
    }
    if "plugin_kwargs" in values and isinstance(values["plugin_kwargs"], Mapping):
        values["plugin_kwargs"] = dict(values["plugin_kwargs"])
    try:
        return TrainConfig(**values)
    except ConfigError as exc:
        raise exc.with_source(source) from None


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """A JSON-ready nested dict of ``config`` (the inverse of :func:`config_from_dict`)."""
    out = dataclasses.asdict(config)
    for name, cls in SECTIONS.items():
        out[name] = {key: out[name][field] for key, field in section_keys(cls).items()}
    return out
