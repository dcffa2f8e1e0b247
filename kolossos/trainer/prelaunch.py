"""Everything ``kolossos train`` checks and prepares before it starts a process.

Nothing here imports ``transformers`` or starts torch.distributed: a bad configuration is
reported in about a second, with nothing started and nothing written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil

from kolossos.trainer.config import TrainConfig
from kolossos.trainer.errors import ConfigError
from kolossos.trainer.paths import RunPaths
from kolossos.trainer.plugins import check_layout, check_plugin_kwargs, plugin_class
from kolossos.trainer.schema import config_to_dict

__all__ = ["check_config", "check_dependencies", "prepare_run_folder", "with_nproc"]

#: sections whose change makes an existing checkpoint unusable
_FIXED_ON_RESUME = ("model", "data", "seed")


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
    """The checks that need the process count: plugin name and keywords, layout.

    Raises:
        ConfigError: an unknown plugin or keyword, or a layout that does not divide.
    """
    cls = plugin_class(config.plugin)
    check_plugin_kwargs(cls, config.plugin_kwargs)
    check_layout(config, world_size)


def check_dependencies(config: TrainConfig) -> None:
    """Fail early, with the install command, when an optional package the run needs is missing.

    Raises:
        ConfigError: ``transformers`` (or ``tokenizers`` for BPE) is not installed.
    """
    needed = [("transformers", "model", "the GPT-2 model")]
    if config.data.tokenizer == "bpe":
        needed.append(("tokenizers", "data.tokenizer", "the BPE tokenizer"))
    for module, key, what in needed:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                key,
                problem=f"{what} needs the '{module}' package, which is not installed.",
                hint=f"Install it: pip install 'kolossos[hf]' (or pip install {module}).",
            )


def _differences(old: dict[str, object], new: dict[str, object]) -> list[str]:
    keys = [k for k in _FIXED_ON_RESUME if old.get(k) != new.get(k)]
    out = []
    for key in keys:
        before, after = old.get(key), new.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
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
        resume: continue the run in its folder.
        overwrite: delete the run folder's previous contents and start again.
        write: change files (only one process of a job should).

    Raises:
        ConfigError: the folder holds checkpoints and neither flag was given, or ``--resume``
            with a model/data/seed that differs from the checkpoint's.
    """
    paths = RunPaths.of(config.output_dir, config.name)
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
        if not resume or latest is None:  # a fresh start: drop what an earlier attempt left
            # only what a run writes: never a folder the user pointed us at
            shutil.rmtree(paths.checkpoints, ignore_errors=True)
            for file in (paths.metrics, paths.plot, paths.sample, paths.summary, paths.tokenizer):
                file.unlink(missing_ok=True)
        paths.root.mkdir(parents=True, exist_ok=True)
        tmp = paths.config.with_name(f".{paths.config.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(new, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, paths.config)
    return paths
