"""The typed configuration of ``kolossos train``: one frozen dataclass per section.

A config file sets any subset of these keys; everything else keeps the defaults below, which
train a small character-level GPT on the bundled Shakespeare corpus. Range checks live in each
section's ``__post_init__`` and raise :class:`~kolossos.train.errors.ConfigError` naming the key,
the value and what is allowed; cross-section rules (the parallel layout) are in
:func:`kolossos.train.schema.check_layout`.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from kolossos.train.errors import ConfigError

__all__ = [
    "DATA_FORMATS",
    "LR_SCHEDULES",
    "PRECISIONS",
    "SEED_MAX",
    "TOKENIZERS",
    "CheckpointSection",
    "DataSection",
    "MetricsSection",
    "ModelSection",
    "SampleSection",
    "TrainConfig",
    "TrainSection",
]

PRECISIONS = ("fp32", "bf16", "fp16")
#: the tokenizers kolossos trains itself (``data.tokenizer`` may also name a Hugging Face folder)
TOKENIZERS = ("char", "bpe")
#: what ``train.schedule`` accepts
LR_SCHEDULES = ("cosine", "linear", "constant")
#: what ``data.format`` accepts
DATA_FORMATS = ("text", "jsonl", "instruction", "parquet", "datasets")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NAME_MAX = 255  # the longest file name most file systems take
#: the largest seed ``torch.manual_seed`` takes
SEED_MAX = 2**64 - 1


def _int(obj: object, name: str, low: int, allowed: str = "") -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(name, value, allowed or f"integers >= {low}")


def _float(
    obj: object,
    name: str,
    low: float,
    high: float = math.inf,
    *,
    open_low: bool = False,
    allowed: str = "",
) -> None:
    value = getattr(obj, name)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bounds = f"{'>' if open_low else '>='} {low:g}" + (
            f" and <= {high:g}" if high != math.inf else ""
        )
        raise ConfigError(name, value, allowed or f"finite numbers {bounds}")
    object.__setattr__(obj, name, float(value))  # TOML/JSON ints become floats


def _choice(obj: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(name, value, ", ".join(repr(c) for c in choices))


def _bool(obj: object, name: str, key: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false")


def _text(obj: object, name: str, allowed: str = "a non-empty string") -> None:
    value = getattr(obj, name)
    if not isinstance(value, str) or not value:
        raise ConfigError(name, value, allowed)


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """``model``: the built-in GPT-2's shape (a ``transformers.GPT2Config``; the vocabulary size
    comes from the tokenizer), or a Hugging Face causal LM from a local folder (``pretrained``)
    or config file (``config``), whose shape then comes from its ``config.json``."""

    n_layer: int = 3
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Hidden size."""
    block_size: int = 64
    """Context length in tokens (``n_positions``); every training sample is this long."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residuals (0 disables it; built-in GPT-2 only)."""
    pretrained: str | None = None
    """A local Hugging Face model folder (``config.json`` plus safetensors or ``.bin`` weights,
    sharded or not) of any ``AutoModelForCausalLM`` architecture, to continue training from. Its
    tokenizer is used unless ``data.tokenizer`` names another folder. No code from the folder
    runs (``trust_remote_code=False``)."""
    config: str | None = None
    """A Hugging Face ``config.json`` (or the folder holding it): train that architecture from
    freshly initialised weights."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (less memory, more compute)."""

    def __post_init__(self) -> None:
        for key in ("pretrained", "config"):
            if getattr(self, key) is not None:
                _text(self, key, "a local folder or file path, or None")
        if self.pretrained is not None and self.config is not None:
            raise ConfigError(
                "config",
                self.config,
                problem="model.pretrained and model.config are both set; a run starts either "
                "from pretrained weights or from a fresh architecture.",
                hint="Keep one of them.",
            )
        _bool(self, "activation_checkpointing", key="activation_checkpointing")
        for name in ("n_layer", "n_head", "n_embd"):
            _int(self, name, 1)
        _int(self, "block_size", 2)
        _float(self, "dropout", 0.0, 1.0, allowed="numbers in [0, 1)")
        if self.dropout >= 1.0:
            raise ConfigError("dropout", self.dropout, "numbers in [0, 1)")
        if self.n_embd % self.n_head and self.hf_source is None:
            fits = [h for h in range(1, min(self.n_embd, 64) + 1) if self.n_embd % h == 0]
            raise ConfigError(
                "n_head",
                self.n_head,
                f"divisors of model.n_embd={self.n_embd} (e.g. {', '.join(map(str, fits[-4:]))})",
                hint="Every head gets n_embd / n_head dimensions.",
            )

    @property
    def hf_source(self) -> str | None:
        """The Hugging Face folder or config file the model comes from (``None``: built-in)."""
        return self.pretrained if self.pretrained is not None else self.config


@dataclass(frozen=True, kw_only=True)
class DataSection:
    """``data``: the corpus, its format, its tokenizer and the validation split."""

    path: str | None = None
    """A UTF-8 text file, or a folder of them, to train on; ``None`` uses the bundled
    Shakespeare corpus."""
    format: str = "text"
    """``'text'`` (plain text files: ``*.txt`` in a folder), ``'jsonl'`` (one JSON object per
    line, its ``text_field`` trained on), ``'instruction'`` (JSON lines with ``prompt_field``
    and ``response_field``; the prompt tokens are masked out of the loss), ``'parquet'`` (the
    ``text_field`` column; needs ``pyarrow``) or ``'datasets'`` (a ``datasets.save_to_disk``
    folder, its ``text_field`` column; needs ``datasets``); ``instruction`` reads prompt and
    response columns from ``jsonl``, ``parquet`` or ``datasets`` data. Except for ``'text'``
    with the ``char`` or ``bpe`` tokenizer, documents are tokenised once into a cached token
    file, joined with the end-of-text token, packed into ``model.block_size`` sequences and
    shuffled each epoch."""
    text_field: str = "text"
    """The field holding the text (``jsonl``, ``parquet``, ``datasets``)."""
    prompt_field: str = "prompt"
    """The field holding the prompt (``instruction``)."""
    response_field: str = "response"
    """The field holding the answer trained on (``instruction``)."""
    instruction: bool = False
    """Read each record's ``prompt_field`` and ``response_field`` instead of its ``text_field``
    and mask the prompt out of the loss, for ``jsonl``, ``parquet`` or ``datasets`` data
    (``format='instruction'`` is ``format='jsonl'`` with ``instruction=true``)."""
    num_proc: int | None = None
    """Processes that tokenise the documents when the token cache is built: ``1`` tokenises in
    this process; ``None`` uses up to 8 of the machine's cores when the data holds at least
    :data:`~kolossos.train.tokenize_pool.PARALLEL_MIN_CHARS` characters, else one. The
    tokens are the same for every value."""
    tokenizer: str = "char"
    """``'char'`` (one token per character of the corpus), ``'bpe'`` (byte-level BPE trained
    on the corpus with the ``tokenizers`` package, cached in the run folder), or a local Hugging
    Face tokenizer folder. With ``model.pretrained``, ``'char'`` means the model folder's
    tokenizer."""
    vocab_size: int = 512
    """Vocabulary size of the BPE tokenizer (ignored by ``'char'``)."""
    val_fraction: float = 0.1
    """Share of the corpus (its end) held out for validation."""

    def __post_init__(self) -> None:
        if self.path is not None:
            _text(self, "path", "a file path, or None for the bundled corpus")
        allowed = "'char', 'bpe' or the path of a Hugging Face tokenizer folder"
        _text(self, "tokenizer", allowed)
        word = "/" not in self.tokenizer and os.sep not in self.tokenizer
        if self.tokenizer not in TOKENIZERS and word and not os.path.exists(self.tokenizer):
            raise ConfigError("tokenizer", self.tokenizer, allowed)  # a typo, not a path
        _choice(self, "format", DATA_FORMATS)
        for name in ("text_field", "prompt_field", "response_field"):
            _text(self, name, "a field name")
        _bool(self, "instruction", key="instruction")
        if self.instruction and self.format == "text":
            raise ConfigError(
                "instruction",
                True,
                problem="data.instruction = true needs records with prompt and response fields, "
                "but data.format = 'text' reads plain text files.",
                hint="Set data.format to 'jsonl', 'parquet' or 'datasets', or "
                "data.instruction=false.",
            )
        if self.num_proc is not None:
            _int(self, "num_proc", 1, "integers >= 1, or None for automatic")
        _int(self, "vocab_size", 257, "integers >= 257 (the 256 bytes plus merges)")
        _float(self, "val_fraction", 0.0, 0.5, open_low=True, allowed="numbers in (0, 0.5]")


#: what ``train.on_nonfinite`` accepts
NON_FINITE_POLICIES = ("stop", "skip", "rollback")


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    """``train``: optimisation, evaluation and logging."""

    steps: int = 1000
    """Optimizer steps to train for."""
    batch_size: int = 32
    """Global batch: sequences per optimizer step over all data-parallel ranks. It must divide
    evenly into data-parallel size x ``gradient_accumulation`` micro-batches."""
    gradient_accumulation: int = 1
    """Micro-batches accumulated per optimizer step on each rank."""
    lr: float = 5e-3
    """Peak learning rate of AdamW."""
    min_lr: float | None = None
    """Learning rate at the end of the cosine decay; ``None`` means ``lr / 10``."""
    warmup_steps: int = 30
    """Steps of linear warm-up from 0 to ``lr``."""
    schedule: str = "cosine"
    """After the warm-up: ``"cosine"`` decay to ``min_lr``, ``"linear"`` decay to ``min_lr``,
    or ``"constant"`` at ``lr``."""
    weight_decay: float = 0.1
    """AdamW weight decay (applied to matrices only, not to biases and norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_interval: int = 100
    """Evaluate the validation loss every this many steps (and at the start and the end)."""
    eval_batches: int = 8
    """Batches of ``batch_size`` sequences in one validation pass."""
    log_interval: int = 10
    """Steps between progress lines (when the output is not a terminal) and between memory
    readings of every rank."""
    on_nonfinite: str = "stop"
    """What a non-finite (inf/NaN) loss does: ``"stop"`` the run (naming the step, the ranks and
    the first non-finite tensor), ``"skip"`` that step's update, or ``"rollback"`` to the latest
    checkpoint and replay without that step. fp16 overflows are not affected: the loss scaler
    skips them as always. A checkpoint is never written with non-finite tensors."""

    def __post_init__(self) -> None:
        _choice(self, "on_nonfinite", NON_FINITE_POLICIES)
        for name in ("steps", "batch_size", "gradient_accumulation", "eval_interval"):
            _int(self, name, 1)
        _int(self, "eval_batches", 1)
        _int(self, "log_interval", 1)
        _int(self, "warmup_steps", 0)
        _choice(self, "schedule", LR_SCHEDULES)
        _float(self, "lr", 0.0, open_low=True)
        if self.min_lr is not None:
            _float(self, "min_lr", 0.0, self.lr, allowed=f"numbers in [0, train.lr={self.lr:g}]")
        _float(self, "weight_decay", 0.0)
        _float(self, "beta1", 0.0, 1.0, allowed="numbers in [0, 1)")
        _float(self, "beta2", 0.0, 1.0, allowed="numbers in [0, 1)")
        for beta in ("beta1", "beta2"):
            if getattr(self, beta) >= 1.0:
                raise ConfigError(beta, getattr(self, beta), "numbers in [0, 1)")
        _float(self, "grad_clip", 0.0)

    @property
    def final_lr(self) -> float:
        """The learning rate the cosine schedule ends at."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """``checkpoint``: periodic checkpoints in ``<output_dir>/<name>/checkpoints/``."""

    every: int = 100
    """Save every this many steps (the last step is always saved)."""
    keep_last: int = 2
    """Complete checkpoints to keep; older ones are deleted after a newer one is complete."""
    async_: bool = False
    """``checkpoint.async``: the step waits only while the state is copied to host memory;
    the files are written in the background and the checkpoint becomes complete (visible to
    ``--resume``, counted by ``keep_last``) once every rank's files are on disk. A crash before
    that leaves the previous checkpoints as they were. Costs host memory for one copy of the
    state on each writing rank."""

    def __post_init__(self) -> None:
        _int(self, "every", 1)
        _int(self, "keep_last", 1)
        _bool(self, "async_", key="async")


@dataclass(frozen=True, kw_only=True)
class SampleSection:
    """``sample``: the text generated from the final model."""

    tokens: int = 300
    """Tokens to generate (0 skips the sample)."""
    prompt: str = "OTHELLO.\n"
    """Text the sample continues."""
    temperature: float = 0.8
    """Sampling temperature (lower is more conservative)."""
    top_k: int = 20
    """Sample among the ``top_k`` most likely tokens (0: all)."""

    def __post_init__(self) -> None:
        _int(self, "tokens", 0)
        _text(self, "prompt")
        _float(self, "temperature", 0.0, open_low=True)
        _int(self, "top_k", 0)


@dataclass(frozen=True, kw_only=True)
class MetricsSection:
    """``metrics``: where the run's numbers go besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = False
    """Also write every training and validation number as TensorBoard scalars to
    ``<output_dir>/<name>/tensorboard/`` (rank 0; needs ``pip install tensorboard``)."""

    def __post_init__(self) -> None:
        _bool(self, "tensorboard", key="tensorboard")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The whole ``kolossos train`` configuration (the top level of a config file)."""

    name: str = "shakespeare-char"
    """Run name: outputs go to ``<output_dir>/<name>/``."""
    output_dir: str = "runs"
    """Folder holding the run folders."""
    seed: int = 1024
    """Seeds the model initialisation, the batch order and the sampling."""
    nproc_per_node: int = 2
    """Processes to start (``--nproc_per_node`` overrides it)."""
    plugin: str = "torch_ddp"
    """A Booster plugin name from ``kolossos.booster.plugin.PLUGINS``."""
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the plugin's constructor (checked by the plugin)."""
    mixed_precision: str = "fp32"
    """``'fp32'``, ``'bf16'`` or ``'fp16'``: the Booster's recipe, or the plugin's ``precision``
    for plugins that control precision themselves."""
    model: ModelSection = field(default_factory=ModelSection)
    """See :class:`ModelSection`."""
    data: DataSection = field(default_factory=DataSection)
    """See :class:`DataSection`."""
    train: TrainSection = field(default_factory=TrainSection)
    """See :class:`TrainSection`."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """See :class:`CheckpointSection`."""
    sample: SampleSection = field(default_factory=SampleSection)
    """See :class:`SampleSection`."""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """See :class:`MetricsSection`."""
    export: bool = False
    """At the end of a finished run, write the last checkpoint as a Hugging Face model folder
    (model and tokenizer) to ``<output_dir>/<name>/hf/`` (``kolossos export`` does it for any
    checkpoint later)."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not _NAME_RE.fullmatch(self.name)
            or len(self.name) > _NAME_MAX
        ):
            raise ConfigError(
                "name",
                self.name,
                f"letters, digits, '.', '_' and '-', at most {_NAME_MAX} of them (a folder name)",
            )
        _text(self, "output_dir", "a folder path")
        _int(self, "seed", 0, f"integers in [0, {SEED_MAX}] (torch's seed range)")
        if self.seed > SEED_MAX:
            raise ConfigError(
                "seed", self.seed, f"integers in [0, {SEED_MAX}] (torch's seed range)"
            )
        _int(self, "nproc_per_node", 1, "integers >= 1 (processes to start on this machine)")
        _text(self, "plugin", "a plugin name such as 'torch_ddp'")
        if not isinstance(self.plugin_kwargs, dict) or not all(
            isinstance(k, str) for k in self.plugin_kwargs
        ):
            raise ConfigError("plugin_kwargs", self.plugin_kwargs, "a table of keyword arguments")
        if "precision" in self.plugin_kwargs:
            raise ConfigError(
                "plugin_kwargs.precision",
                self.plugin_kwargs["precision"],
                problem="plugin_kwargs.precision is not used: the precision is set in one place.",
                hint="Set mixed_precision instead; kolossos passes it to plugins that control "
                "precision themselves.",
            )
        _choice(self, "mixed_precision", PRECISIONS)
        _bool(self, "export", key="export")
        self._tokenizer_from_model()

    def _tokenizer_from_model(self) -> None:
        """With ``model.pretrained``, the default ``'char'`` tokenizer means the model's own
        (recorded as its folder, so the run's config says what it used)."""
        if self.model.pretrained is None:
            return
        if self.data.tokenizer == "char":
            data = copy.copy(self.data)  # the folder is checked before launch, with the model
            object.__setattr__(data, "tokenizer", self.model.pretrained)
            object.__setattr__(self, "data", data)
        elif self.data.tokenizer == "bpe":
            raise ConfigError(
                "data.tokenizer",
                "bpe",
                problem="data.tokenizer = 'bpe' trains a new tokenizer, but model.pretrained = "
                f"{self.model.pretrained!r} was trained with its own.",
                hint="Leave data.tokenizer out (the model folder's tokenizer is used), or name a "
                "tokenizer folder of the same vocabulary.",
            )
