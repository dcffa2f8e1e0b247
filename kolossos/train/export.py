"""A run's checkpoint as a Hugging Face model folder: ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load it directly.

The model is rebuilt from the run's ``config.json`` (the architecture only), the checkpoint's
weights are loaded into it (they are saved in Hugging Face names by every plugin), and it is
saved with ``save_pretrained`` next to the tokenizer: the Hugging Face tokenizer the run used,
or the run's own character or BPE tokenizer converted to a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kolossos.train.config import TOKENIZERS, TrainConfig
from kolossos.train.errors import ConfigError

__all__ = ["RunModel", "export_run", "hf_tokenizer_of", "load_run_model", "read_run_config"]


@dataclass
class RunModel:
    """A run's model loaded from one checkpoint, with its tokenizer."""

    model: torch.nn.Module
    """The model (fp32, CPU, eval mode)."""
    tokenizer: Any
    """The trainer's tokenizer (``encode``/``decode``)."""
    config: TrainConfig
    """The run's configuration."""
    checkpoint: Path
    """The checkpoint folder loaded."""
    step: int
    """Its step."""


def read_run_config(run_dir: str | Path, checkpoint: Path | None = None) -> TrainConfig:
    """The configuration a run was trained with: the one saved in ``checkpoint`` (default: the
    run's latest complete checkpoint).

    Raises:
        ConfigError: ``run_dir`` is not a run folder, or has no complete checkpoint.
    """
    from kolossos.train.paths import RunPaths
    from kolossos.train.schema import config_from_dict

    folder = Path(run_dir)
    if checkpoint is None:
        checkpoint = _checkpoint(folder, None)[1]
    state = RunPaths(folder).read_state(checkpoint)
    return config_from_dict(state["config"], source=str(checkpoint))


def _checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    from kolossos.train.paths import complete_checkpoints

    if not (run_dir / "checkpoints").is_dir():
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            problem=f"{str(run_dir)!r} is not a kolossos train run folder (it has no "
            "checkpoints/).",
            hint="Pass <output_dir>/<name> of a run.",
        )
    found = complete_checkpoints(run_dir / "checkpoints")
    if not found:
        raise ConfigError(
            "RUN_DIR", str(run_dir), problem=f"the run {str(run_dir)!r} has no complete checkpoint."
        )
    if step is None:
        return found[-1]
    for item in found:
        if item[0] == step:
            return item
    steps = ", ".join(str(s) for s, _ in found)
    raise ConfigError("--step", step, f"the steps of the run's complete checkpoints: {steps}")


def _run_tokenizer(config: TrainConfig, run_dir: Path) -> Any:
    from kolossos.train.data import BPETokenizer, CharTokenizer
    from kolossos.train.hf_model import load_hf_tokenizer
    from kolossos.train.state_files import read_tokenizer_file

    if config.data.tokenizer not in TOKENIZERS:
        return load_hf_tokenizer(config.data.tokenizer)
    data = read_tokenizer_file(run_dir / "tokenizer.json")
    if data["kind"] == "char":
        return CharTokenizer(data["chars"])
    return BPETokenizer.from_str(data["tokenizer"])


def load_run_model(run_dir: str | Path, step: int | None = None) -> RunModel:
    """The model of a run's checkpoint (the latest complete one, or ``step``'s).

    Raises:
        ConfigError: not a run folder, no such checkpoint.
    """
    from kolossos.checkpoint_io import GeneralCheckpointIO
    from kolossos.train.model import build_model

    folder = Path(run_dir)
    found_step, checkpoint = _checkpoint(folder, step)
    config = read_run_config(folder, checkpoint)
    tokenizer = _run_tokenizer(config, folder)
    model = build_model(config.model, tokenizer.vocab_size, load_weights=False)
    GeneralCheckpointIO().load_model(model, checkpoint / "model")
    model.eval()
    return RunModel(model, tokenizer, config, checkpoint, found_step)


def hf_tokenizer_of(tokenizer: Any) -> Any:
    """The trainer's tokenizer as a ``transformers`` tokenizer (to save with the model)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from kolossos.train.data import BPETokenizer, CharTokenizer
    from kolossos.train.hf_import import transformers_module as _transformers
    from kolossos.train.hf_model import HFTokenizer

    transformers = _transformers()
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.backend
    if isinstance(tokenizer, BPETokenizer):
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    assert isinstance(tokenizer, CharTokenizer)
    vocab = {c: i for i, c in enumerate(tokenizer.chars)}
    backend = Backend(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters join without spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Write a run's checkpoint (latest, or ``step``) as a Hugging Face model folder.

    Args:
        run_dir: ``<output_dir>/<name>`` of a run.
        out_dir: the folder to create; it must not exist or be empty (nothing is overwritten).
        step: the checkpoint's step (default: the latest complete one).

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: not a run folder, no such checkpoint, or ``out_dir`` holds files.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            "OUT_DIR",
            str(out_dir),
            problem=f"{str(out_dir)!r} already exists and is not an empty folder; the export "
            "never writes over files.",
            hint="Pass a new folder.",
        )
    loaded = load_run_model(run_dir, step)
    model: Any = loaded.model
    model.config.use_cache = True  # training turned it off; generation wants it
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    hf_tokenizer_of(loaded.tokenizer).save_pretrained(str(tmp))
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(tmp, out)
    return out
