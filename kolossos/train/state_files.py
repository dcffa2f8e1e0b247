"""Reading the JSON files of a run safely: the trainer state of a checkpoint and the tokenizer.

Every reader here parses JSON only (nothing in a run folder is ever executed), checks the
structure the trainer wrote, and turns every problem into a :class:`CheckpointFileError` naming
the file and what is wrong with it. The module uses the standard library only, so the command line
can read a checkpoint's state before it starts torch (``kolossos train --resume`` compares the
configuration first).

Example:
    >>> state = read_state_file(Path("runs/gpt/checkpoints/step_000100/trainer_state.json"))
    ... # doctest: +SKIP
    >>> state["step"]  # doctest: +SKIP
    100
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kolossos.train.errors import ConfigError

__all__ = [
    "TOKENIZER_HINT",
    "CheckpointFileError",
    "read_json_file",
    "read_state_file",
    "read_tokenizer_file",
]

_DAMAGED = (
    "The checkpoint is damaged: delete its folder to resume from the previous checkpoint, or "
    "start the run again with --overwrite."
)

#: how to fix a damaged tokenizer file of a run
TOKENIZER_HINT = (
    "Delete the file to rebuild it from the corpus (the same corpus and data settings give the "
    "same tokenizer), or start the run again with --overwrite."
)


class CheckpointFileError(ConfigError):
    """A file of a run (checkpoint state, RNG state, tokenizer...) cannot be used.

    The trainer's counterpart of :class:`kolossos.checkpoint_io.CheckpointError` for the files
    it writes itself. It is a :class:`~kolossos.train.errors.ConfigError` (key ``--resume``),
    so ``kolossos train`` prints it as one paragraph and exits with code 2 before training.

    Args:
        file: the file at fault.
        reason: what is wrong with it (the message names the file unless ``reason`` does).
        hint: how to fix it (default: resume from the previous checkpoint, or ``--overwrite``).

    Attributes:
        file: the file at fault.
        reason: what is wrong with it.
    """

    def __init__(self, file: str | os.PathLike[str], reason: str, hint: str = _DAMAGED) -> None:
        self.file = Path(file)
        self.reason = reason
        named = reason if str(self.file) in reason else f"checkpoint file {str(file)!r}: {reason}"
        super().__init__("--resume", problem=named.rstrip(".") + ".", hint=hint)

    def __reduce__(self) -> tuple[Any, ...]:  # survives broadcast_object_list between ranks
        return type(self), (self.file, self.reason, self.hint)


def read_json_file(path: str | os.PathLike[str], hint: str = _DAMAGED) -> Any:
    """Parse the JSON file ``path``.

    Raises:
        CheckpointFileError: the file is missing, unreadable, not UTF-8, empty or not valid JSON
            (with the line and column of the first error).
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointFileError(file, "the file does not exist", hint) from None
    except UnicodeDecodeError as exc:
        raise CheckpointFileError(
            file, f"not a JSON document: byte {exc.start} is not UTF-8 text (junk bytes?)", hint
        ) from None
    except OSError as exc:
        raise CheckpointFileError(file, f"cannot be read: {exc}", hint) from None
    if not text.strip():
        raise CheckpointFileError(file, "the file is empty (an interrupted write?)", hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointFileError(
            file,
            f"not a valid JSON document at line {exc.lineno}, column {exc.colno}: {exc.msg} "
            "(truncated or corrupted?)",
            hint,
        ) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_state_file(path: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The trainer state stored in a checkpoint (``trainer_state.json``), checked.

    Args:
        path: the file.
        step: the step the checkpoint's folder name says (checked against the file's ``step``).

    Returns:
        The state: ``step`` (an int >= 0) and the optional ``config`` (an object),
        ``elapsed_s`` (a number >= 0) and ``world_size`` (an int >= 1), plus any other entries.

    Raises:
        CheckpointFileError: unreadable or invalid JSON, or a state of the wrong structure.
    """
    state = read_json_file(path)
    if not isinstance(state, dict):
        raise CheckpointFileError(
            path, f"a trainer state must be a JSON object, found a {type(state).__name__}"
        )
    if "step" not in state:
        raise CheckpointFileError(path, f"the trainer state lacks 'step' (it has {sorted(state)})")
    checks = (
        ("step", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        ("config", lambda v: isinstance(v, dict), "a JSON object"),
        ("elapsed_s", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
        ("world_size", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    )
    for key, ok, what in checks:
        if key in state and not ok(state[key]):
            raise CheckpointFileError(
                path, f"the trainer state's {key!r} must be {what}, found {_show(state[key])}"
            )
    if step is not None and state["step"] != step:
        raise CheckpointFileError(
            path,
            f"the trainer state says step {state['step']} but its folder is the checkpoint of "
            f"step {step} (a file copied from another checkpoint?)",
        )
    return state


def read_tokenizer_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """The tokenizer a run saved (``tokenizer.json``), checked: ``{"kind": "char", "chars":
    ...}`` with distinct characters, or ``{"kind": "bpe", "tokenizer": <tokenizers JSON>}``.

    Raises:
        CheckpointFileError: unreadable or invalid JSON, or another structure.
    """
    hint = TOKENIZER_HINT
    data = read_json_file(path, hint)
    if not isinstance(data, dict) or data.get("kind") not in ("char", "bpe"):
        found = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise CheckpointFileError(
            path,
            "a tokenizer file must be a JSON object with 'kind' 'char' or 'bpe', found "
            f"{_show(found)}",
            hint,
        )
    field = "chars" if data["kind"] == "char" else "tokenizer"
    value = data.get(field)
    if not isinstance(value, str) or not value:
        raise CheckpointFileError(
            path,
            f"a {data['kind']!r} tokenizer needs {field!r} as a non-empty string, found "
            f"{_show(value)}",
            hint,
        )
    if field == "chars" and len(set(value)) != len(value):
        raise CheckpointFileError(path, "the 'chars' of a char tokenizer repeat a character", hint)
    return {"kind": data["kind"], field: value}
