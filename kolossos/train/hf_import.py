"""The lazy import of ``transformers`` (with the install hint) and the model switches every
Hugging Face model of the trainer shares; imported by both the built-in GPT-2 and the
``model.pretrained`` / ``model.config`` builders."""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["enable_activation_checkpointing", "transformers_module"]


def transformers_module() -> Any:
    """``transformers``, quiet (errors only, no progress bars).

    Raises:
        ModuleNotFoundError: it is not installed, with the command that installs it.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "kolossos train builds its models with the 'transformers' package, which is not "
            "installed: pip install 'kolossos[hf]'  (or: pip install transformers)"
        ) from exc
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def enable_activation_checkpointing(model: Any) -> None:
    """Turn on a Hugging Face model's block recomputation (``gradient_checkpointing_enable``,
    the name every transformers version since 4.40 has; newer ones warn that it is renamed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
