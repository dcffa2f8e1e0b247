"""The plugin side of a training config: the name, its keyword arguments and the parallel layout.

Plugins come from the registry :data:`kolossos.booster.plugin.PLUGINS`, so a plugin registered
there is usable by ``kolossos train`` with no change here. Before any process starts, keyword
names are checked against the plugin constructor's signature, the values by the plugin's own
config (:meth:`~kolossos.booster.plugin.Plugin.check_arguments`, no process group needed), and
the layout for divisibility; the plugin checks again when the worker builds it. A refused value
(``TypeError``/``ValueError``/``NotImplementedError``) becomes a :class:`ConfigError` naming
``plugin_kwargs.<key>``.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kolossos.train.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from kolossos.booster.plugin import Plugin
    from kolossos.train.config import TrainConfig

__all__ = [
    "MODEL_PARALLEL_KEYS",
    "Layout",
    "build_plugin",
    "check_layout",
    "check_model_split",
    "check_plugin_values",
    "plugin_arguments",
    "plugin_class",
]

#: plugin keyword arguments whose product is the model-parallel size (data parallel gets the rest)
MODEL_PARALLEL_KEYS = ("tp_size", "pp_size", "sp_size")
#: sequence-parallel modes with a group of their own (the others reuse the tensor-parallel group)
_OWN_SP_GROUP = ("all_to_all", "ring_attn")


def plugin_class(name: str) -> type[Plugin]:
    """The registered plugin class called ``name``.

    Raises:
        ConfigError: an unknown name, listing the available ones and the closest match.
    """
    from kolossos.booster.plugin import PLUGINS

    if name in PLUGINS:
        return PLUGINS[name]
    guess = did_you_mean(name, PLUGINS)
    hint = f"Did you mean {guess!r}?" if guess else ""
    raise ConfigError(
        "plugin",
        name,
        ", ".join(repr(n) for n in sorted(PLUGINS)) + " (the plugins of this kolossos version)",
        hint=hint,
    )


def _parameters(cls: type[Any]) -> tuple[list[inspect.Parameter], bool]:
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL,)
    ]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    return [p for p in params if p.kind != p.VAR_KEYWORD], var_kw


def check_plugin_kwargs(cls: type[Any], kwargs: dict[str, Any]) -> None:
    """Check ``kwargs`` names against ``cls``'s constructor (no values are checked here).

    Raises:
        ConfigError: an unknown keyword (with a suggestion) or a missing required one.
    """
    params, var_kw = _parameters(cls)
    names = [p.name for p in params]
    if not var_kw:
        for key in kwargs:
            if key not in names:
                raise ConfigError.unknown_key(
                    f"plugin_kwargs.{key}", names, section="plugin_kwargs"
                ).with_source(f"{cls.__name__}'s keyword arguments")
    for p in params:
        if p.default is p.empty and p.name not in kwargs and p.name != "precision":
            raise ConfigError(
                f"plugin_kwargs.{p.name}",
                problem=f"plugin_kwargs.{p.name} is required by {cls.__name__} and missing.",
                hint=f"Set it, e.g. plugin_kwargs.{p.name}=... on the command line.",
            )


def takes_precision(cls: type[Any]) -> bool:
    """Whether the plugin's constructor has a ``precision`` argument (it controls precision)."""
    params, _ = _parameters(cls)
    return any(p.name == "precision" for p in params)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the processes and the global batch are divided."""

    world_size: int
    """All processes."""
    dp_size: int
    """Data-parallel replicas (``world_size`` / model-parallel size)."""
    micro_batch: int
    """Sequences per rank per micro-batch."""


def check_layout(config: TrainConfig, world_size: int, dp_size: int | None = None) -> Layout:
    """Check that the processes and the batch divide as the config asks.

    Args:
        config: the validated config.
        world_size: processes in the job.
        dp_size: the data-parallel size a built plugin reports; by default derived from
            ``world_size`` and the model-parallel sizes in ``plugin_kwargs``.

    Raises:
        ConfigError: a model-parallel size that does not divide the processes, or a batch that
            does not divide among the data-parallel ranks and accumulation steps.
    """
    kwargs = config.plugin_kwargs
    keys = [k for k in MODEL_PARALLEL_KEYS if k != "sp_size"]
    if kwargs.get("sequence_parallelism_mode") in _OWN_SP_GROUP:
        keys.append("sp_size")
    sizes = {k: kwargs.get(k) or 1 for k in keys}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"plugin_kwargs.{key}", value, "integers >= 1")
    model_parallel = math.prod(sizes.values())
    if dp_size is None:
        if world_size % model_parallel:
            shown = " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1)
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(
                "plugin_kwargs",
                problem=f"the model-parallel layout {shown} = {model_parallel} processes does not "
                f"divide the {world_size} processes of this job (nproc_per_node={world_size}).",
                hint=f"The product must be one of {divisors}; change the sizes or start a "
                f"multiple of {model_parallel} processes with --nproc_per_node.",
            )
        dp_size = world_size // model_parallel
    train = config.train
    per_step = dp_size * train.gradient_accumulation
    if train.batch_size % per_step:
        lower = max(per_step, train.batch_size - train.batch_size % per_step)
        raise ConfigError(
            "train.batch_size",
            train.batch_size,
            f"multiples of {per_step} (e.g. {lower} or {lower + per_step})",
            hint=f"The global batch is split evenly over {dp_size} data-parallel rank(s) x "
            f"{train.gradient_accumulation} accumulation step(s) (train.gradient_accumulation); "
            "change train.batch_size, train.gradient_accumulation or --nproc_per_node.",
        )
    return Layout(world_size=world_size, dp_size=dp_size, micro_batch=train.batch_size // per_step)


def check_model_split(config: TrainConfig, layout: Layout) -> None:
    """Check the model-parallel sizes in ``plugin_kwargs`` against the model and the batch:
    tensor parallelism splits the attention heads; a pipeline needs a transformer block per
    stage, takes no gradient accumulation, and splits each rank's batch into micro-batches.

    Args:
        config: the validated config (``plugin_kwargs`` values already checked by the plugin).
        layout: what :func:`check_layout` found.

    Raises:
        ConfigError: a size the model or the batch cannot be split by.
    """
    kwargs = config.plugin_kwargs
    n_head, n_layer, heads_key, layers_key = _model_shape(config)
    tp = kwargs.get("tp_size") or 1
    if n_head % tp:
        fits = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ConfigError(
            "plugin_kwargs.tp_size",
            tp,
            f"divisors of {heads_key}={n_head} ({', '.join(map(str, fits))})",
            hint="Tensor parallelism gives every process n_head / tp_size attention heads; "
            f"change plugin_kwargs.tp_size or {heads_key}.",
        )
    _check_kv_heads(config, tp)
    pp = kwargs.get("pp_size") or 1
    if pp == 1:
        return
    stages = pp * (kwargs.get("num_model_chunks") or 1)
    if n_layer < stages:
        own = config.model.hf_source is None
        fix = f"Set model.n_layer >= {stages}" if own else f"Use a model of >= {stages} blocks"
        raise ConfigError(
            "plugin_kwargs.pp_size",
            pp,
            problem=f"plugin_kwargs.pp_size = {pp} with {stages // pp} model chunk(s) makes "
            f"{stages} pipeline stages, but {layers_key} = {n_layer} blocks cannot fill "
            "them (every stage needs at least one).",
            hint=f"{fix}, or use fewer stages.",
        )
    layers = kwargs.get("num_layers_per_stage")
    if layers is not None and sum(layers) != n_layer:
        raise ConfigError(
            "plugin_kwargs.num_layers_per_stage",
            layers,
            f"counts that sum to {layers_key}={n_layer}",
        )
    if config.train.gradient_accumulation > 1:
        raise ConfigError(
            "train.gradient_accumulation",
            config.train.gradient_accumulation,
            "1 with a pipeline",
            hint=f"{config.plugin} splits each batch into micro-batches itself (see its "
            "plugin_kwargs num_microbatches / microbatch_size).",
        )
    _check_micro_batches(kwargs, layout)


def _check_kv_heads(config: TrainConfig, tp: int) -> None:
    """Grouped-query attention: tensor parallelism splits the key/value heads too."""
    model = config.model
    if tp == 1 or model.hf_source is None:
        return
    from kolossos.train.hf_files import hf_shape

    key = "model.pretrained" if model.pretrained is not None else "model.config"
    kv = hf_shape(key, model.hf_source).n_kv_head
    if kv is not None and kv % tp:
        fits = [d for d in range(1, kv + 1) if kv % d == 0]
        raise ConfigError(
            "plugin_kwargs.tp_size",
            tp,
            f"divisors of the key/value heads of {key}={kv} ({', '.join(map(str, fits))})",
            hint="The model uses grouped-query attention; tensor parallelism gives every process "
            "num_key_value_heads / tp_size of them. Change plugin_kwargs.tp_size or the model.",
        )


def _model_shape(config: TrainConfig) -> tuple[int, int, str, str]:
    """Heads and blocks of the configured model, and how to name them in messages."""
    model = config.model
    if model.hf_source is None:
        return model.n_head, model.n_layer, "model.n_head", "model.n_layer"
    from kolossos.train.hf_files import hf_shape

    key = "model.pretrained" if model.pretrained is not None else "model.config"
    shape = hf_shape(key, model.hf_source)
    where = f"the attention heads of {key}"
    return shape.n_head, shape.n_layer, where, f"the blocks of {key}"


def _check_micro_batches(kwargs: dict[str, Any], layout: Layout) -> None:
    count, size = kwargs.get("num_microbatches"), kwargs.get("microbatch_size")
    key, value = ("num_microbatches", count) if count else ("microbatch_size", size)
    if value and layout.micro_batch % value:
        fits = [d for d in range(1, layout.micro_batch + 1) if layout.micro_batch % d == 0]
        raise ConfigError(
            f"plugin_kwargs.{key}",
            value,
            f"divisors of {layout.micro_batch} ({', '.join(map(str, fits[-6:]))})",
            hint=f"Each data-parallel rank trains {layout.micro_batch} sequences per step "
            f"(train.batch_size / {layout.dp_size} data-parallel rank(s)), which the pipeline "
            "splits evenly; change the value or train.batch_size.",
        )


def plugin_arguments(cls: type[Any], config: TrainConfig) -> dict[str, Any]:
    """The keyword arguments the trainer constructs ``cls`` with: ``plugin_kwargs``, plus
    ``mixed_precision`` as ``precision`` for plugins that control precision."""
    kwargs = dict(config.plugin_kwargs)
    if takes_precision(cls):
        kwargs["precision"] = config.mixed_precision
    return kwargs


def _named_key(kwargs: dict[str, Any], text: str) -> str | None:
    """The keyword a plugin's error message names first (``stage`` is not found in
    ``zero_stage``)."""
    found = []
    for key in kwargs:
        match = re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", text)
        if match:
            found.append((match.start(), key))
    return min(found)[1] if found else None


def _rejected(
    cls: type[Any], config: TrainConfig, kwargs: dict[str, Any], exc: Exception
) -> ConfigError:
    """The :class:`ConfigError` for a plugin's ``TypeError``/``ValueError``/
    ``NotImplementedError``, naming ``plugin_kwargs.<key>`` (or ``mixed_precision``)."""
    text = str(exc)
    named = _named_key(kwargs, text)
    key = f"plugin_kwargs.{named}" if named else "plugin_kwargs"
    value = kwargs[named] if named else config.plugin_kwargs
    if named and named not in config.plugin_kwargs:  # the precision we passed
        key, value = "mixed_precision", config.mixed_precision
    return ConfigError(
        key,
        value,
        problem=f"{key} = {value!r} was rejected by {cls.__name__}: {text}",
        hint="Fix the value in the config file or override it on the command line.",
    )


#: what a plugin raises for arguments it refuses (anything else is a bug, not a config error)
_REFUSALS = (TypeError, ValueError, NotImplementedError)


def check_plugin_values(config: TrainConfig) -> None:
    """Validate the plugin's keyword values without a process group (the plugin's
    :meth:`~kolossos.booster.plugin.Plugin.check_arguments`: its engine config, built as the
    constructor would build it).

    Raises:
        ConfigError: a value the plugin rejects, naming ``plugin_kwargs.<key>``.
    """
    cls = plugin_class(config.plugin)
    kwargs = plugin_arguments(cls, config)
    try:
        with warnings.catch_warnings():  # advice is given once, by the plugin in the worker
            warnings.simplefilter("ignore")
            cls.check_arguments(**kwargs)
    except _REFUSALS as exc:
        raise _rejected(cls, config, kwargs, exc) from exc


def build_plugin(config: TrainConfig) -> Plugin:
    """Construct the configured plugin (needs the process group), passing ``mixed_precision`` as
    ``precision`` to plugins that control precision.

    Raises:
        ConfigError: the plugin rejected its arguments (``TypeError``/``ValueError``/
            ``NotImplementedError``).
    """
    cls = plugin_class(config.plugin)
    kwargs = plugin_arguments(cls, config)
    try:
        return cls(**kwargs)
    except _REFUSALS as exc:
        raise _rejected(cls, config, kwargs, exc) from exc
