"""Crash safety: a save that is killed or fails leaves the previous checkpoint loadable."""

from __future__ import annotations

import io as iolib
import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.checkpoint_io import GeneralCheckpointIO, atomic, register_param_names
from kolossos.checkpoint_io.atomic import atomic_directory, readable_directory

pytest.importorskip("safetensors")

LIMIT_MB = 10 / 1024  # 10 KiB shards: the model below needs three


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])


def assert_state(model: nn.Module, seed: int) -> None:
    for (name, got), want in zip(
        model.state_dict().items(), build(seed).state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name


def _save_and_stop(conn: Any, path: str, mode: str) -> None:
    """Child process: start saving seed-1 weights over ``path``, report, and wait to be killed."""

    def stop(*_: Any) -> None:
        conn.send(mode)
        signal.pause()

    model = build(1)
    if mode == "file":  # stop half-way through writing the single file
        real_save = torch.save

        def half_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            buffer = iolib.BytesIO()
            real_save(obj, buffer)
            with open(f, "wb") as out:
                out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            stop()

        torch.save = half_save  # type: ignore[assignment]
        GeneralCheckpointIO().save_model(model, path)
    else:  # stop right after the first shard is committed
        atomic._ON_FILE_COMMITTED.append(stop)
        GeneralCheckpointIO().save_model(
            model, path, shard=True, size_per_shard=LIMIT_MB, use_safetensors=True
        )


def _kill_mid_save(path: Path, mode: str) -> None:
    ctx = mp.get_context("fork")  # the harness keeps one intra-op thread, so forking is safe
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_save_and_stop, args=(sender, str(path), mode))
    child.start()
    try:
        assert receiver.poll(60), "the saving process never reached the stop point"
        assert receiver.recv() == mode
    finally:
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(30)
    assert child.exitcode == -signal.SIGKILL


def test_kill_during_sharded_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    path = tmp_path / "ckpt"
    io.save_model(build(0), path, shard=True, size_per_shard=LIMIT_MB, use_safetensors=True)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    _kill_mid_save(path, "sharded")

    staging = tmp_path / ".ckpt.kolossos-staging"
    written = [p.name for p in staging.iterdir() if not p.name.startswith(".")]
    assert written == [], written  # killed before any final-named file appeared in staging
    assert len(list(staging.iterdir())) == 1  # one committed shard, no index: a partial save
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # untouched
    model = build(7)
    io.load_model(model, path)
    assert_state(model, 0)

    # the next save cleans up after the killed one and succeeds
    io.save_model(build(1), path, shard=True, size_per_shard=LIMIT_MB, use_safetensors=True)
    assert not staging.exists()
    io.load_model(model, path)
    assert_state(model, 1)


def test_kill_during_single_file_save_keeps_previous_file(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    path = tmp_path / "model.bin"
    io.save_model(build(0), path)
    before = path.read_bytes()

    _kill_mid_save(path, "file")

    assert path.read_bytes() == before
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".model.bin.kolossos-tmp-")
    model = build(7)
    io.load_model(model, path)
    assert_state(model, 0)
    io.save_model(build(1), path)  # removes the stale temporary file
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("what", ["model", "optimizer"])
def test_exception_during_save_keeps_previous_checkpoint(tmp_path: Path, what: str) -> None:
    io = GeneralCheckpointIO()
    path = tmp_path / "ckpt"

    def save(seed: int) -> None:
        model = build(seed)
        if what == "model":
            io.save_model(model, path, shard=True, size_per_shard=LIMIT_MB)
            return
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        register_param_names(opt, model)
        model(torch.ones(1, 32)).sum().backward()
        opt.step()
        io.save_optimizer(opt, path, shard=True, size_per_shard=LIMIT_MB)

    save(0)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def fail(_: Path) -> None:
        raise OSError(28, "No space left on device")

    atomic._ON_FILE_COMMITTED.append(fail)
    try:
        with pytest.raises(OSError, match="No space left"):
            save(1)
    finally:
        atomic._ON_FILE_COMMITTED.remove(fail)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # staging removed


def test_swap_without_rename_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where RENAME_EXCHANGE is unavailable, the two-rename fallback is recoverable."""
    io = GeneralCheckpointIO()
    path = tmp_path / "ckpt"
    io.save_model(build(0), path, shard=True, size_per_shard=LIMIT_MB)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    io.save_model(build(1), path, shard=True, size_per_shard=LIMIT_MB)
    model = build(7)
    io.load_model(model, path)
    assert_state(model, 1)

    # a crash between "rename old away" and "rename new in": readers use the old directory
    real_rename = os.rename

    def crash_on_second(src: Any, dst: Any) -> None:
        if str(src).endswith(".kolossos-staging"):
            raise KeyboardInterrupt  # stands for the process dying here
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        io.save_model(build(2), path, shard=True, size_per_shard=LIMIT_MB)
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert not path.exists() and readable_directory(path) == tmp_path / ".ckpt.kolossos-old"
    io.load_model(model, path)
    assert_state(model, 1)
    io.save_model(build(2), path, shard=True, size_per_shard=LIMIT_MB)  # recovers, then saves
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    io.load_model(model, path)
    assert_state(model, 2)


def test_atomic_directory_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"), atomic_directory(tmp_path / "f"):
        pass
