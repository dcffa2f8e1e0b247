"""Causal LMs from a local Hugging Face folder (``config.json`` plus weights).

Nothing is downloaded (``local_files_only=True``) and no code from the folder runs
(``trust_remote_code=False``).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

__all__ = ["load_causal_lm"]


def load_causal_lm(path: str | Path) -> nn.Module:
    """The model saved in ``path`` (by ``save_pretrained``), in eval mode, with its saved dtype.

    Raises:
        FileNotFoundError: ``path`` is not a folder with a ``config.json``.
        ImportError: transformers is not installed.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a Hugging Face model folder (no config.json in it); pass the "
            "folder save_pretrained() wrote, or a model object."
        )
    try:
        import transformers
    except ImportError as err:  # optional dependency
        raise ImportError(
            "loading a model folder needs transformers: pip install 'kolossos[hf]'"
        ) from err
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, trust_remote_code=False
    )
    return model.eval()
