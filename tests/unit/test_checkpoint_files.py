"""Every file of a trainer checkpoint is loaded through a checking reader: a truncated, junk,
wrongly structured or code-running file is refused with an error naming the file and the
problem, before anything is restored. The checkpoints are real: written by the trainer's
``Checkpointer`` in one process (a tiny model, ``Booster()`` without plugin)."""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kolossos.booster import Booster
from kolossos.checkpoint_io import CheckpointError
from kolossos.testing.parity import TinyMLP
from kolossos.train import checkpoint_files
from kolossos.train.checkpoint_files import agree_on_error, read_rng_file
from kolossos.train.checkpoints import Checkpointer, capture_rng, restore_rng
from kolossos.train.config import DataSection
from kolossos.train.data import load_corpus
from kolossos.train.errors import ConfigError
from kolossos.train.paths import STATE_FILE, RunPaths
from kolossos.train.state_files import CheckpointFileError, read_state_file

RNG = Path("rng") / "rank_00000.pt"
SCHED = "lr_scheduler.bin"


class _Run:
    """A run with one checkpoint (step 3) and a way to build fresh objects to load it into."""

    def __init__(self, root: Path) -> None:
        self.paths = RunPaths(root)
        first = self.checkpointer(seed=0)
        x = torch.randn(4, 16)
        for _ in range(3):
            first.model(x).square().mean().backward()
            first.optimizer.step()
            first.optimizer.zero_grad()
            first.lr_scheduler.step()
        self.folder = first.save(3, {"elapsed_s": 1.5, "config": {"seed": 0}, "world_size": 1})
        self.expected_rng = torch.rand(3)  # what the RNG gives right after the save

    def checkpointer(self, seed: int) -> Checkpointer:
        torch.manual_seed(seed)
        model = TinyMLP()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        booster = Booster()
        model, boosted, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
        return Checkpointer(booster, model, boosted, sched, self.paths, keep_last=2)

    def load_fails(self, exc: type[Exception] = CheckpointFileError) -> Exception:
        """Load into fresh objects; the load must fail and leave the model untouched."""
        fresh = self.checkpointer(seed=1)
        before = [p.detach().clone() for p in fresh.model.parameters()]
        with pytest.raises(exc) as info:
            fresh.load(self.folder)
        after = list(fresh.model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        return info.value


@pytest.fixture
def run(tmp_path: Path) -> _Run:
    return _Run(tmp_path / "run")


def _says(exc: BaseException, file: Path | str, *words: str) -> None:
    """The message names ``file`` and contains every word (the trainer's: in one paragraph;
    checkpoint IO's may quote torch's multi-line refusal of a pickle)."""
    text = str(exc)
    assert str(file) in text, text
    for word in words:
        assert word in text, f"{word!r} not in: {text}"
    assert "\n" not in text or not isinstance(exc, ConfigError)


class _RunsCode:
    """Unpickling this creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


# --------------------------------------------------------------------------- the good path
def test_checkpoint_round_trip(run: _Run) -> None:
    fresh = run.checkpointer(seed=1)
    torch.manual_seed(123)
    state = fresh.load(run.folder)
    assert state["step"] == 3 and state["elapsed_s"] == 1.5 and state["world_size"] == 1
    assert torch.equal(torch.rand(3), run.expected_rng)  # this rank's RNG came back
    assert fresh.lr_scheduler.last_epoch == 3
    assert run.paths.read_state(run.folder) == state


# --------------------------------------------------------------------------- trainer_state.json
@pytest.mark.parametrize(
    ("content", "words"),
    [
        (lambda text: text[: len(text) // 2], ["not a valid JSON document at line", "column"]),
        (lambda text: "", ["is empty"]),
        (lambda text: b"\xff\xfe\x00junk", ["not UTF-8"]),
        (lambda text: "[1, 2]", ["must be a JSON object, found a list"]),
        (lambda text: '{"config": {}}', ["lacks 'step'"]),
        (lambda text: '{"step": "3"}', ["'step' must be an integer >= 0, found '3'"]),
        (lambda text: '{"step": 3, "config": []}', ["'config' must be a JSON object"]),
        (lambda text: '{"step": 3, "elapsed_s": -1}', ["'elapsed_s' must be a number >= 0"]),
        (lambda text: '{"step": 7}', ["says step 7", "step 3"]),
    ],
    ids=["truncated", "empty", "junk", "list", "no-step", "str-step", "config", "time", "step"],
)
def test_damaged_trainer_state(run: _Run, content: Callable[[str], Any], words: list[str]) -> None:
    file = run.folder / STATE_FILE
    new = content(file.read_text())
    if isinstance(new, bytes):
        file.write_bytes(new)
    else:
        file.write_text(new)
    with pytest.raises(CheckpointFileError) as info:
        run.paths.read_state(run.folder)  # what `kolossos train --resume` reads first
    for exc in (run.load_fails(), info.value):
        _says(exc, file, *words, "delete its folder", "--overwrite")
        assert isinstance(exc, ConfigError)  # `kolossos train` prints it and exits with 2
    missing = run.folder.parent / "step_000009" / STATE_FILE
    with pytest.raises(CheckpointFileError, match="does not exist"):
        read_state_file(missing)


# --------------------------------------------------------------------------- rng/rank_NNNNN.pt
def _good_rng() -> dict[str, Any]:
    return capture_rng()


def _rng_cases(marker: Path) -> list[tuple[str, Any, list[str]]]:
    good = _good_rng()
    np_state = good.get("numpy")
    cases: list[tuple[str, Any, list[str]]] = [
        ("list", [1, 2], ["RNG state of rank 0 must be the dict capture_rng writes, found a list"]),
        ("no-torch", {"python": good["python"]}, ["RNG state of rank 0 lacks 'torch'"]),
        ("extra", {**good, "cuda": 1}, ["unknown entries ['cuda']"]),
        ("float", {**good, "torch": good["torch"].float()}, ["'torch' must be a 1-D uint8"]),
        ("short", {**good, "torch": good["torch"][:100]}, ["'torch' must have 5056 bytes"]),
        ("py-pair", {**good, "python": good["python"][:2]}, ["'python' must be random.getstate"]),
        ("py-index", {**good, "python": (3, (0,) * 624 + (9999,), None)}, ["'python' is not a"]),
        ("code", {**good, "torch": _RunsCode(marker)}, ["safe loading refuses"]),
    ]
    if np_state is not None:
        kind, keys, pos, has_gauss, cached = np_state
        cases += [
            ("np-dtype", {**good, "numpy": (kind, keys.int(), pos, has_gauss, cached)},
             ["'numpy' must hold its keys as a 1-D int64 tensor"]),
            ("np-kind", {**good, "numpy": ("PCG64", keys, pos, has_gauss, cached)},
             ["'numpy' must be an 'MT19937' state"]),
        ]  # fmt: skip
    return cases


def test_damaged_rng_files(run: _Run, tmp_path: Path) -> None:
    file = run.folder / RNG
    marker = tmp_path / "pwned"
    for name, state, words in _rng_cases(marker):
        torch.save(state, file)
        _says(run.load_fails(), file, *words)
        with pytest.raises(CheckpointFileError) as info:
            read_rng_file(file, rank=0)
        _says(info.value, file, *words)
        assert not marker.exists(), name
    raw = file.read_bytes()
    for content, words in (
        (raw[: len(raw) // 2], ["corrupt or truncated"]),
        (b"", ["is empty"]),
        (b"\x00junk bytes, not a torch file", ["neither a safetensors nor a torch file"]),
    ):
        file.write_bytes(content)
        _says(run.load_fails(), file, *words)


def test_restore_rng_checks_before_restoring() -> None:
    state = _good_rng()
    before = torch.get_rng_state()
    py_before = random.getstate()
    with pytest.raises(ValueError, match="RNG state lacks 'python'"):
        restore_rng({"torch": state["torch"]})
    bad_python = {**state, "python": (3, (1, 2), None)}
    with pytest.raises(ValueError, match="'python' must hold 625 integers"):
        restore_rng(bad_python)
    assert torch.equal(torch.get_rng_state(), before) and random.getstate() == py_before
    expected = torch.rand(2)
    torch.set_rng_state(before)
    restore_rng(state)
    assert torch.equal(torch.rand(2), expected)


# --------------------------------------------------------------------------- lr_scheduler.bin
def test_damaged_lr_scheduler_file(run: _Run, tmp_path: Path) -> None:
    file = run.folder / SCHED
    raw = file.read_bytes()
    model = TinyMLP()
    other_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(other_opt, step_size=2).state_dict()
    good = torch.load(file, weights_only=True)
    two_groups = {**good, "base_lrs": [0.1, 0.1]}
    marker = tmp_path / "pwned"
    cases: list[tuple[Any, list[str]]] = [
        (raw[: len(raw) // 2], ["corrupt or truncated"]),
        (b"\x00junk", ["neither a safetensors nor a torch file"]),
        ({"foo": 1}, ["LR scheduler state for LambdaLR must have keys [", "the file has ['foo']"]),
        (step_lr, ["LambdaLR must have keys", "missing ['lr_lambdas']"]),
        ({**good, "last_epoch": "3"}, ["'last_epoch' must be a number", "found a str"]),
        ({**good, "last_epoch": None}, ["'last_epoch' must be a number", "found a NoneType"]),
        (two_groups, ["'base_lrs' has 2 entries", "has 1 param groups"]),
        ({**good, "base_lrs": ["x"]}, ["'base_lrs' must hold one learning rate"]),
        ([good], ["holds a list, not a state dict"]),
        ({**good, "lr_lambdas": [_RunsCode(marker)]}, ["safe loading refuses"]),
    ]  # fmt: skip
    for content, words in cases:
        if isinstance(content, bytes):
            file.write_bytes(content)
        else:
            torch.save(content, file)
        exc = run.load_fails()
        _says(exc, file, *words)
        assert isinstance(exc.__cause__, CheckpointError)  # what booster.load_lr_scheduler raises
        fresh = run.checkpointer(seed=1)
        with pytest.raises(CheckpointError) as info:
            fresh.booster.load_lr_scheduler(fresh.lr_scheduler, str(file))
        _says(info.value, file, *words)
        assert fresh.lr_scheduler.last_epoch == 0  # nothing was loaded
        assert not marker.exists()


# --------------------------------------------------------------------------- tokenizer.json
def _corpus(tmp_path: Path, tokenizer: str = "char") -> tuple[DataSection, Path]:
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question. " * 40, encoding="utf-8")
    return DataSection(path=str(text), tokenizer=tokenizer, vocab_size=300), tmp_path / "tok.json"


def test_damaged_tokenizer_file(run: _Run, tmp_path: Path) -> None:
    section, _ = _corpus(tmp_path)
    saved = run.paths.tokenizer
    corpus = load_corpus(section, 8, saved)  # writes the run's tokenizer
    assert load_corpus(section, 8, saved).tokenizer.vocab_size == corpus.tokenizer.vocab_size
    text = saved.read_text()
    for content, words in (
        (text[:-5], ["not a valid JSON document at line 1"]),
        ("\xff".encode("latin-1"), ["not UTF-8"]),
        ('{"kind": "word"}', ["'kind' 'char' or 'bpe', found 'word'"]),
        ('["char"]', ["found 'list'"]),
        ('{"kind": "char", "chars": 5}', ["needs 'chars' as a non-empty string, found 5"]),
        ('{"kind": "char", "chars": "aab"}', ["repeat a character"]),
        ('{"kind": "bpe", "tokenizer": "{}"}', ["not a valid 'tokenizers' BPE model"]),
    ):
        if isinstance(content, bytes):
            saved.write_bytes(content)
        else:
            saved.write_text(content)
        with pytest.raises(CheckpointFileError) as info:
            load_corpus(section, 8, saved)
        _says(info.value, saved, *words, "Delete the file to rebuild it")


# --------------------------------------------------------------------------- several ranks
def test_every_rank_raises_the_first_error(monkeypatch: pytest.MonkeyPatch) -> None:
    error = CheckpointFileError("ckpt/rng/rank_00001.pt", "RNG state of rank 1 lacks 'torch'")
    copy = pickle.loads(pickle.dumps(error))  # what all_gather_object hands the other ranks
    assert str(copy) == str(error) and copy.file == error.file

    def all_gather_object(out: list[Any], obj: Any) -> None:
        out[:] = [obj, copy]  # rank 0 (this process) is fine, rank 1 is not

    fake = checkpoint_files.dist
    monkeypatch.setattr(fake, "is_initialized", lambda: True)
    monkeypatch.setattr(fake, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(fake, "all_gather_object", all_gather_object)
    with pytest.raises(CheckpointFileError, match=r"rank_00001\.pt.*rank 1 lacks 'torch'"):
        agree_on_error(None)


def test_error_message_is_one_paragraph(tmp_path: Path) -> None:
    file = tmp_path / STATE_FILE
    file.write_text(json.dumps({"step": 1})[:-1])
    with pytest.raises(CheckpointFileError) as info:
        read_state_file(file)
    text = str(info.value)
    assert text.startswith(f"checkpoint file {str(file)!r}: not a valid JSON document at line 1")
    assert info.value.file == file and info.value.key == "--resume"
