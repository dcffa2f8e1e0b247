"""Everything ``kolossos train`` checks and prepares before it starts a process.

Nothing here imports ``transformers`` or starts torch.distributed: a bad configuration is
reported in about a second, with nothing started and nothing written.
"""

from __future__ import annotations

import codecs
import dataclasses
import importlib.util
import json
import os
import shutil
from pathlib import Path

from kolossos.train.config import TOKENIZERS, TrainConfig
from kolossos.train.data import corpus_path, read_corpus_text, saved_chars, split_point
from kolossos.train.documents import data_files, is_packed, read_documents
from kolossos.train.errors import ConfigError
from kolossos.train.hf_files import (
    check_model_folder,
    check_tokenizer_folder,
    check_vocabulary,
    hf_shape,
)
from kolossos.train.paths import RunPaths
from kolossos.train.plugins import (
    check_layout,
    check_model_split,
    check_plugin_kwargs,
    check_plugin_values,
    plugin_class,
)
from kolossos.train.schema import config_to_dict

__all__ = [
    "CHEAP_CORPUS_BYTES",
    "RESUME_MODES",
    "check_config",
    "check_data",
    "check_dependencies",
    "check_model_source",
    "prepare_run_folder",
    "resolve_resume",
    "with_nproc",
]

#: sections whose change makes an existing checkpoint unusable
_FIXED_ON_RESUME = ("model", "data", "seed")
#: ``--resume`` modes: start fresh; continue (a checkpoint must exist); continue if there is one
RESUME_MODES = ("no", "must", "auto")
#: corpus files up to this size are read before launch (prompt and length checks); larger ones
#: only have their first bytes checked, the workers check the rest
CHEAP_CORPUS_BYTES = 64 * 2**20


def with_nproc(config: TrainConfig, nproc: int | None) -> TrainConfig:
    """``config`` with ``--nproc_per_node`` applied (``None`` keeps the config's value).

    Raises:
        ConfigError: a value below 1, named as the command-line flag.
    """
    if nproc is None:
        return config
    try:
        return dataclasses.replace(config, nproc_per_node=nproc)
    except ConfigError as exc:
        raise ConfigError("--nproc_per_node", nproc, exc.allowed, source="command line") from None


def check_config(config: TrainConfig, world_size: int) -> None:
    """The checks of the plugin and the layout: plugin name, keyword names and values (by the
    plugin's own config), and how the processes, the model and the batch divide.

    Raises:
        ConfigError: an unknown plugin or keyword, a value the plugin rejects, or a layout that
            does not divide.
    """
    cls = plugin_class(config.plugin)
    check_plugin_kwargs(cls, config.plugin_kwargs)
    check_plugin_values(config)
    check_model_split(config, check_layout(config, world_size))


def check_dependencies(config: TrainConfig) -> None:
    """Fail early, with the install command, when an optional package the run needs is missing.

    Raises:
        ConfigError: ``transformers`` (or ``tokenizers`` for BPE, ``tensorboard`` for
            ``metrics.tensorboard``) is not installed.
    """
    needed = [("transformers", "model", "the model")]
    if config.data.tokenizer not in ("char",):
        needed.append(("tokenizers", "data.tokenizer", "the BPE tokenizer"))
    if config.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "metrics.tensorboard",
            True,
            problem="metrics.tensorboard = true writes TensorBoard scalars, which needs the "
            "'tensorboard' package; it is not installed.",
            hint="Install it: pip install tensorboard (or pip install 'kolossos[data]'; or set "
            "metrics.tensorboard=false: metrics.jsonl is written either way).",
        )
    for module, key, what in needed:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                key,
                problem=f"{what} needs the '{module}' package, which is not installed.",
                hint=f"Install it: pip install 'kolossos[hf]' (or pip install {module}).",
            )


def _corpus_file(config: TrainConfig) -> tuple[Path, int]:
    """The corpus file and its size, checked to be a non-empty, readable file."""
    given = config.data.path
    path = corpus_path(config.data)
    hint = "Pass the path of a UTF-8 text file, or data.path=None for the bundled corpus."
    if not os.path.exists(path):  # never raises (pathlib's may, on a forbidden folder)
        raise ConfigError(
            "data.path",
            given,
            problem=f"data.path = {given!r}: the corpus file {str(path)!r} does not exist "
            f"(looked in {os.getcwd()}).",
            hint=hint,
        )
    if not os.path.isfile(path):
        raise ConfigError(
            "data.path",
            given,
            problem=f"data.path = {given!r} is a folder, not a file.",
            hint=hint + " A folder of text files trains with a Hugging Face tokenizer "
            "(model.pretrained, or data.tokenizer=<tokenizer folder>); 'char' and 'bpe' take one "
            "file.",
        )
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(
            "data.path", given, problem=f"data.path = {given!r} is an empty file.", hint=hint
        )
    return path, size


def _corpus_head(config: TrainConfig, path: Path) -> None:
    """Check that a large corpus can be opened and starts as UTF-8 text."""
    try:
        with path.open("rb") as fh:
            codecs.getincrementaldecoder("utf-8")().decode(fh.read(1 << 16), final=False)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "data.path",
            config.data.path,
            "a readable UTF-8 text file",
            hint=f"Reading {str(path)!r} failed: {exc}.",
        ) from None


def _vocabulary(config: TrainConfig, text: str, source: str, resume: bool) -> str:
    """The characters the run's character tokenizer will know: the saved tokenizer's when the
    run continues (it is fixed at the first start), else the corpus's."""
    saved = saved_chars(RunPaths.of(config.output_dir, config.name).tokenizer) if resume else None
    if saved is None:
        return "".join(sorted(set(text)))
    unknown = sorted(set(text) - set(saved))
    if unknown:
        raise ConfigError(
            "data.path",
            config.data.path,
            "the corpus the run's tokenizer was built from",
            hint=f"{source} now holds characters {''.join(unknown[:20])!r} that the run's saved "
            "character tokenizer does not know; restore the corpus, or start a new run name.",
        )
    return saved


def _check_char_corpus(config: TrainConfig, text: str, source: str, resume: bool) -> None:
    """What the character tokenizer makes of the corpus: the prompt must be encodable, and both
    parts of the corpus must hold a ``block_size`` window."""
    chars = _vocabulary(config, text, source, resume)
    sample = config.sample
    missing = sorted(set(sample.prompt) - set(chars))
    if sample.tokens and missing:
        raise ConfigError(
            "sample.prompt",
            sample.prompt,
            "text made of characters of the corpus",
            hint=f"The character tokenizer of {source} cannot encode {''.join(missing)!r}; "
            "change the prompt, or set sample.tokens=0 to skip the sample.",
        )
    train = split_point(len(text), config.data.val_fraction)
    val = len(text) - train
    block = config.model.block_size
    if min(train, val) < block:
        raise ConfigError(
            "model.block_size",
            block,
            f"at most {min(train, val)} tokens for this corpus and data.val_fraction",
            hint=f"{source} has {len(text)} characters (one token each): {train} for training, "
            f"{val} for validation; use a longer text or a shorter block_size.",
        )


def check_model_source(config: TrainConfig) -> None:
    """Check ``model.pretrained`` (a complete model folder), ``model.config`` (a readable
    ``config.json``) and a Hugging Face ``data.tokenizer`` folder against the model's
    vocabulary, from the files alone.

    Raises:
        ConfigError: naming the key, what is missing and the fix.
    """
    model, data = config.model, config.data
    shape = None
    if model.pretrained is not None:
        shape = check_model_folder(model.pretrained)
    elif model.config is not None:
        shape = hf_shape("model.config", model.config)
    if data.tokenizer in TOKENIZERS:
        return
    check_tokenizer_folder(data.tokenizer)
    if shape is not None and model.pretrained is not None:
        check_vocabulary(data.tokenizer, shape, "model.pretrained", model.pretrained)


def _check_documents(config: TrainConfig) -> None:
    """Read a packed data set before launch (when small): missing fields, empty data."""
    files = data_files(config.data)
    if sum(f.stat().st_size for f in files) <= CHEAP_CORPUS_BYTES:
        read_documents(config.data)


def check_data(config: TrainConfig, *, resume: bool = False) -> None:
    """Check the corpus before launch: an existing, non-empty UTF-8 file; with the character
    tokenizer also the sample prompt and the corpus length against ``model.block_size``.

    Files up to :data:`CHEAP_CORPUS_BYTES` are read whole (the bundled corpus is 1.3 MB);
    larger ones only have their start checked, the workers check the rest.

    Args:
        config: the validated configuration.
        resume: the run continues, so it keeps the character tokenizer saved at its first start.

    Raises:
        ConfigError: naming ``data.path``, ``sample.prompt`` or ``model.block_size``.
    """
    check_model_source(config)
    if is_packed(config.data):
        _check_documents(config)
        return
    path, size = _corpus_file(config)
    if size > CHEAP_CORPUS_BYTES:
        _corpus_head(config, path)
        return
    text, source = read_corpus_text(config.data)
    if config.data.tokenizer == "char":
        _check_char_corpus(config, text, source, resume)


def resolve_resume(config: TrainConfig, mode: str, *, overwrite: bool = False) -> bool:
    """Whether the run continues from a checkpoint, for a ``--resume`` mode.

    Args:
        config: the validated configuration.
        mode: ``"no"`` (start fresh), ``"must"`` (``--resume``: continue; there must be a
            checkpoint) or ``"auto"`` (``--resume=auto``: continue if there is one).
        overwrite: ``--overwrite`` was given (it contradicts any resume).

    Raises:
        ConfigError: ``--resume`` without a complete checkpoint, or with ``--overwrite``.
    """
    if mode not in RESUME_MODES:
        raise ValueError(f"mode={mode!r} must be one of {RESUME_MODES}")
    flag = "--resume=auto" if mode == "auto" else "--resume"
    if mode != "no" and overwrite:
        raise ConfigError(
            "--overwrite",
            True,
            problem=f"{flag} and --overwrite contradict each other.",
            hint="Pass one of them.",
        )
    latest = RunPaths.of(config.output_dir, config.name).latest_checkpoint()
    if mode == "must" and latest is None:
        raise _nothing_to_resume(config)
    return mode == "must" or (mode == "auto" and latest is not None)


def _nothing_to_resume(config: TrainConfig) -> ConfigError:
    paths = RunPaths.of(config.output_dir, config.name)
    return ConfigError(
        "--resume",
        True,
        problem=f"--resume: the run '{config.name}' has no complete checkpoint in "
        f"{paths.checkpoints} to continue from.",
        hint="Drop --resume to start the run, or pass --resume=auto to continue when there is a "
        "checkpoint and start fresh otherwise.",
    )


def _check_output(config: TrainConfig, paths: RunPaths) -> None:
    """Check, without writing, that the run folder can be created and written: the nearest
    existing folder on its path must be a writable folder."""
    existing = paths.root
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    hint = "Point output_dir at a folder you can write to (it is created if missing)."
    if not existing.is_dir():
        raise ConfigError(
            "output_dir",
            config.output_dir,
            problem=f"output_dir = {config.output_dir!r}: the run folder {paths.root} cannot be "
            f"created because {existing} is a file, not a folder.",
            hint=hint + " Or choose another name=.",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            "output_dir",
            config.output_dir,
            problem=f"output_dir = {config.output_dir!r}: the run folder {paths.root} cannot be "
            f"written: {existing} is not writable (permissions or a read-only file system).",
            hint=hint,
        )
    if paths.checkpoints.exists() and not paths.checkpoints.is_dir():
        raise ConfigError(
            "name",
            config.name,
            problem=f"{paths.checkpoints} is a file, where the run keeps its checkpoints folder.",
            hint="Move the file away, or choose another name= or output_dir=.",
        )


def _differences(old: dict[str, object], new: dict[str, object]) -> list[str]:
    keys = [k for k in _FIXED_ON_RESUME if old.get(k) != new.get(k)]
    defaults = config_to_dict(TrainConfig())
    out = []
    for key in keys:
        before, after = old.get(key), new.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            default = defaults.get(key)
            assert isinstance(default, dict)
            # a key added to kolossos after the checkpoint was written counts as its default
            before = {k: before.get(k, default.get(k)) for k in set(before) | set(after)}
            out += [
                f"{key}.{k}: {before.get(k)!r} -> {after.get(k)!r}"
                for k in sorted(set(before) | set(after))
                if before.get(k) != after.get(k)
            ]
        else:
            out.append(f"{key}: {before!r} -> {after!r}")
    return out


def prepare_run_folder(
    config: TrainConfig, *, resume: bool, overwrite: bool, write: bool = True
) -> RunPaths:
    """Check the run folder against ``--resume``/``--overwrite`` and write ``config.json``.

    Args:
        config: the validated configuration.
        resume: continue the run in its folder (it must have a complete checkpoint; see
            :func:`resolve_resume` for ``--resume=auto``).
        overwrite: delete the run folder's previous contents and start again.
        write: change files (only one process of a job should).

    Raises:
        ConfigError: the run folder cannot be created or written; the folder holds checkpoints
            and neither flag was given; ``--resume`` without a checkpoint, or with a
            model/data/seed that differs from the checkpoint's.
    """
    paths = RunPaths.of(config.output_dir, config.name)
    _check_output(config, paths)
    latest = paths.latest_checkpoint()
    if latest is not None and not resume and not overwrite:
        raise ConfigError(
            "name",
            config.name,
            problem=f"the run '{config.name}' already has checkpoints in {paths.checkpoints} "
            f"(latest: step {latest[0]}).",
            hint="Pass --resume to continue it, --overwrite to delete it and start again, or "
            "name=<new name> for a separate run.",
        )
    if resume and overwrite:
        raise ConfigError(
            "--overwrite",
            True,
            problem="--resume and --overwrite contradict each other.",
            hint="Pass one of them.",
        )
    if resume and latest is None:
        raise _nothing_to_resume(config)
    new = config_to_dict(config)
    if resume and latest is not None:
        old = paths.read_state(latest[1]).get("config", {})
        changed = _differences(old, new)
        if changed:
            raise ConfigError(
                "--resume",
                True,
                problem=f"the checkpoint {latest[1]} was trained with a different "
                f"configuration: {'; '.join(changed)}.",
                hint="Resume with the original model, data and seed settings, or start a new "
                "run with another name=.",
            )
    if write:
        try:
            _write_run_folder(paths, new, fresh=not resume)
        except OSError as exc:
            raise ConfigError(
                "output_dir",
                config.output_dir,
                problem=f"output_dir = {config.output_dir!r}: writing the run folder {paths.root} "
                f"failed: {exc}.",
                hint="Point output_dir at a folder you can write to.",
            ) from None
    return paths


def _write_run_folder(paths: RunPaths, config: dict[str, object], *, fresh: bool) -> None:
    if fresh:  # drop what an earlier attempt left
        # only what a run writes: never a folder the user pointed us at
        shutil.rmtree(paths.checkpoints, ignore_errors=True)
        shutil.rmtree(paths.export, ignore_errors=True)
        for file in (paths.metrics, paths.plot, paths.sample, paths.summary, paths.tokenizer):
            file.unlink(missing_ok=True)
    paths.root.mkdir(parents=True, exist_ok=True)
    tmp = paths.config.with_name(f".{paths.config.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, paths.config)
