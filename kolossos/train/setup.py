"""Build everything a training run needs on one rank: plugin, corpus, model, optimizer,
schedule, Booster. Called after the process group is up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kolossos.train.config import TrainConfig, TrainSection
from kolossos.train.data import Corpus, load_corpus
from kolossos.train.documents import is_packed
from kolossos.train.errors import ConfigError
from kolossos.train.model import build_model, causal_lm_loss, count_parameters
from kolossos.train.packed import PackedCorpus, load_packed
from kolossos.train.paths import RunPaths
from kolossos.train.plugins import Layout, build_plugin, check_layout

if TYPE_CHECKING:
    from kolossos.booster.plugin import Plugin

__all__ = ["TOKEN_CACHE", "RunParts", "build_run", "load_data", "lr_lambda"]

#: the folder of ``output_dir`` holding token caches (shared by the runs there)
TOKEN_CACHE = ".token_cache"


@dataclass
class RunParts:
    """The boosted objects and facts of one rank's run."""

    config: TrainConfig
    """The validated configuration."""
    paths: RunPaths
    """Where the run writes."""
    layout: Layout
    """Process and batch division."""
    rank: int
    """Global rank."""
    dp_rank: int
    """Data-parallel rank: which slice of each global batch this rank trains on."""
    corpus: Corpus | PackedCorpus
    """Tokens and tokenizer."""
    booster: Any
    """The :class:`kolossos.booster.Booster`."""
    model: torch.nn.Module
    """The boosted model."""
    optimizer: Any
    """The boosted optimizer (an ``OptimizerWrapper``)."""
    criterion: Any
    """The boosted criterion ``(outputs, batch) -> loss``."""
    lr_scheduler: Any
    """The learning-rate schedule (stepped once per optimizer step)."""
    n_params: int
    """Parameters of the model (tied weights once)."""
    pipeline: bool
    """Whether steps go through ``booster.execute_pipeline``."""


def lr_lambda(train: TrainSection) -> Any:
    """The schedule factor of each step: linear warm-up, then ``train.schedule``: cosine or
    linear decay to ``final_lr``, or constant."""
    floor = train.final_lr / train.lr

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / (train.warmup_steps + 1)
        if train.schedule == "constant":
            return 1.0
        span = max(1, train.steps - train.warmup_steps)
        progress = min(1.0, (step - train.warmup_steps) / span)
        if train.schedule == "linear":
            return 1 - (1 - floor) * progress
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _optimizer(model: torch.nn.Module, train: TrainSection) -> torch.optim.Optimizer:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2))


def load_data(config: TrainConfig, paths: RunPaths) -> Corpus | PackedCorpus:
    """The run's tokens: the original corpus mode, or the packed, cached data set."""
    if not is_packed(config.data):
        return load_corpus(config.data, config.model.block_size, paths.tokenizer)
    cache = Path(config.output_dir).expanduser() / TOKEN_CACHE
    return load_packed(config.data, config.model.block_size, paths.tokenizer, cache)


def _load_corpus_once(config: TrainConfig, paths: RunPaths, rank: int) -> Corpus | PackedCorpus:
    """Rank 0 builds (or reads) the run's tokenizer and token cache first; the others then
    read them."""
    corpus: Corpus | PackedCorpus | None = None
    error: list[Any] = [None]
    if rank == 0:
        try:
            corpus = load_data(config, paths)
        except ConfigError as exc:
            error[0] = exc
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)  # SYNC POINT: the tokenizer file exists now
    if error[0] is not None:
        raise error[0]
    return corpus or load_data(config, paths)


def _check_prompt(config: TrainConfig, corpus: Corpus | PackedCorpus) -> None:
    if not config.sample.tokens:
        return
    try:
        ids = corpus.tokenizer.encode(config.sample.prompt)
    except ValueError as exc:
        raise ConfigError(
            "sample.prompt",
            config.sample.prompt,
            "text made of characters of the corpus",
            hint=f"The character tokenizer cannot encode it: {exc}.",
        ) from None
    if not ids:
        raise ConfigError("sample.prompt", config.sample.prompt, "text of at least one token")


def _make_booster(config: TrainConfig, plugin: Plugin) -> Any:
    from kolossos.booster import Booster

    if plugin.control_precision() or config.mixed_precision == "fp32":
        precision = None  # the plugin got it as precision=..., or there is nothing to do
    else:
        precision = config.mixed_precision
    try:
        return Booster(mixed_precision=precision, plugin=plugin)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            "mixed_precision",
            config.mixed_precision,
            f"what {config.plugin} supports",
            hint=str(exc),
        ) from exc


def build_run(config: TrainConfig) -> RunParts:
    """Build and boost everything for this rank (the process group must be initialised).

    Raises:
        ConfigError: the plugin rejected its arguments or the precision, the layout does not
            divide, or the corpus cannot be used.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    plugin = build_plugin(config)
    layout = check_layout(config, world, plugin.dp_size)
    pipeline = bool(plugin.support_pipeline())
    if pipeline and config.train.gradient_accumulation > 1:
        raise ConfigError(
            "train.gradient_accumulation",
            config.train.gradient_accumulation,
            "1 with a pipeline",
            hint=f"{config.plugin} splits each batch into micro-batches itself "
            "(see its plugin_kwargs).",
        )
    paths = RunPaths.of(config.output_dir, config.name)
    corpus = _load_corpus_once(config, paths, rank)
    _check_prompt(config, corpus)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model = build_model(config.model, corpus.tokenizer.vocab_size)
    n_params = count_parameters(model)
    optimizer = _optimizer(model, config.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config.train))
    booster = _make_booster(config, plugin)
    model, boosted_opt, criterion, _, scheduler = booster.boost(
        model, optimizer, causal_lm_loss, lr_scheduler=scheduler
    )
    return RunParts(
        config=config,
        paths=paths,
        layout=layout,
        rank=rank,
        dp_rank=plugin.dp_rank,
        corpus=corpus,
        booster=booster,
        model=model,
        optimizer=boosted_opt,
        criterion=criterion,
        lr_scheduler=scheduler,
        n_params=n_params,
        pipeline=pipeline,
    )
