"""Fault injection: non-finite losses and weights in ``kolossos train`` (2 ranks, in process).

A NaN loss is injected on one rank at one step (the trainer's forward is wrapped), or the
learning rate is absurd so the run really diverges. Each ``train.on_nonfinite`` policy must do
what it says, every rank must agree, and no checkpoint on disk may ever hold a non-finite tensor.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel  # noqa: F401  (imported once, before forking)

import kolossos.train.worker as worker
from kolossos.interface import unwrap_model
from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.loop import Trainer
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths, complete_checkpoints
from kolossos.train.worker import EXIT_NONFINITE, run_worker

TINY = [
    "model.n_layer=1",
    "model.n_embd=16",
    "model.n_head=2",
    "model.block_size=16",
    "train.steps=8",
    "train.batch_size=4",
    "train.warmup_steps=1",
    "train.eval_interval=100",
    "train.eval_batches=1",
    "train.log_interval=4",
    "checkpoint.every=2",
    "checkpoint.keep_last=2",
    "sample.tokens=4",
]


def _config(tmp_path: Path, *extra: str) -> Any:
    return load_config(None, [*TINY, f"output_dir={tmp_path}", "name=run", *extra])


def _inject_nan(monkeypatch: pytest.MonkeyPatch, at_step: int, on_rank: int, times: int) -> None:
    """Make ``on_rank``'s loss NaN at ``at_step`` (the first ``times`` times that step runs)."""
    left = [times]

    class Faulty(Trainer):
        _now = 0  # the step being trained (0: evaluation)

        def step(self, step: int) -> Any:
            self._now = step
            return super().step(step)

        def _forward_loss(self, batch: Any, optimizer: Any) -> torch.Tensor | None:
            loss = super()._forward_loss(batch, optimizer)
            hit = self._now == at_step and dist.get_rank() == on_rank and left[0] > 0
            if hit and loss is not None:
                left[0] -= 1
                return loss * float("nan")
            return loss

    monkeypatch.setattr(worker, "Trainer", Faulty)


def _all_finite_on_disk(paths: RunPaths) -> list[int]:
    """The steps of the complete checkpoints, after checking each holds only finite values."""
    steps = []
    for step, folder in complete_checkpoints(paths.checkpoints):
        for file in (folder / "model").glob("*.safetensors"):
            for name, tensor in load_file(str(file)).items():
                assert torch.isfinite(tensor).all(), (folder, name)
        steps.append(step)
    return steps


def _train_steps(paths: RunPaths) -> list[int]:
    return [r["step"] for r in read_metrics(paths.metrics) if r["kind"] == "train"]


@distributed(2)
def test_stop_names_the_step_and_keeps_the_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inject_nan(monkeypatch, at_step=3, on_rank=1, times=1)
    config = _config(tmp_path)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == EXIT_NONFINITE
    paths = RunPaths.of(str(tmp_path), "run")
    assert _train_steps(paths) == [1, 2]  # step 3 never updated the weights
    assert _all_finite_on_disk(paths) == [2]
    if dist.get_rank() == 0:
        text = err.getvalue()
        assert "step 3: the loss is not finite" in text and "on_nonfinite='stop'" in text, text


@distributed(2)
def test_skip_drops_one_update_and_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inject_nan(monkeypatch, at_step=3, on_rank=0, times=1)
    config = _config(tmp_path, "train.on_nonfinite=skip")
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0
    paths = RunPaths.of(str(tmp_path), "run")
    assert _train_steps(paths) == [1, 2, 4, 5, 6, 7, 8]
    events = [r for r in read_metrics(paths.metrics) if r["kind"] == "nonfinite"]
    assert [(e["step"], e["policy"]) for e in events] == [(3, "skip")]
    assert _all_finite_on_disk(paths) == [6, 8]


@distributed(2)
def test_rollback_replays_from_the_last_checkpoint_without_the_bad_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inject_nan(monkeypatch, at_step=5, on_rank=1, times=1)
    config = _config(tmp_path, "train.on_nonfinite=rollback")
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0
    paths = RunPaths.of(str(tmp_path), "run")
    # back to the checkpoint of step 4, then 5 is skipped and 6.. trained once each
    assert _train_steps(paths) == [1, 2, 3, 4, 6, 7, 8]
    assert _all_finite_on_disk(paths) == [6, 8]


@distributed(2)
def test_a_diverging_run_never_writes_a_non_finite_checkpoint(tmp_path: Path) -> None:
    config = _config(tmp_path, "train.lr=1e12", "train.grad_clip=0", "checkpoint.every=1")
    code = run_worker(config, stream=io.StringIO(), install_signals=False)
    paths = RunPaths.of(str(tmp_path), "run")
    assert code == EXIT_NONFINITE
    _all_finite_on_disk(paths)  # every checkpoint left is finite ...
    assert len(_train_steps(paths)) < 8  # ... and the run did stop early


@distributed(2)
def test_skip_cannot_help_non_finite_weights_so_it_stops_naming_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Poisoned(Trainer):
        def step(self, step: int) -> Any:
            if step == 3 and dist.get_rank() == 1:
                with torch.no_grad():
                    next(self.p.model.parameters()).fill_(float("nan"))
            return super().step(step)

    monkeypatch.setattr(worker, "Trainer", Poisoned)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    config = _config(tmp_path, "train.on_nonfinite=skip")
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == EXIT_NONFINITE
    assert _all_finite_on_disk(RunPaths.of(str(tmp_path), "run")) == [2]
    if dist.get_rank() == 0:
        text = err.getvalue()
        assert "rank 1: first non-finite tensor" in text and "wte.weight" in text, text
        assert "skipping the update cannot help" in text, text


# Plugins whose constructor needs an argument the default config does not give.
NEEDS = {"hybrid_parallel": ["plugin_kwargs.tp_size=2"]}


@pytest.mark.parametrize(
    ("plugin", "precision"),
    [
        ("torch_ddp", "bf16"),
        ("torch_ddp", "fp16"),
        ("low_level_zero", "fp32"),
        ("low_level_zero", "bf16"),
        ("gemini", "bf16"),
        ("torch_fsdp", "fp32"),
        ("hybrid_parallel", "fp32"),
    ],
)
@distributed(2)
def test_every_plugin_and_precision_stops_at_a_nan_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin: str, precision: str
) -> None:
    _inject_nan(monkeypatch, at_step=3, on_rank=1, times=1)
    config = _config(
        tmp_path, f"plugin={plugin}", f"mixed_precision={precision}", *NEEDS.get(plugin, [])
    )
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == EXIT_NONFINITE
    paths = RunPaths.of(str(tmp_path), "run")
    assert _train_steps(paths) == [1, 2]
    assert _all_finite_on_disk(paths) == [2]


@distributed(2)
def test_an_fp16_overflow_is_still_skipped_and_rescaled_not_stopped(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "plugin=low_level_zero",
        "mixed_precision=fp16",
        f"plugin_kwargs.initial_scale={2.0**32}",  # the first steps overflow fp16
    )
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0
    paths = RunPaths.of(str(tmp_path), "run")
    assert _train_steps(paths) == list(range(1, 9))
    assert not [r for r in read_metrics(paths.metrics) if r["kind"] == "nonfinite"]
    assert _all_finite_on_disk(paths) == [6, 8]


@distributed(2)
def test_a_nan_gradient_on_one_rank_is_caught_by_the_norm_and_skipped_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class NanGradient(Trainer):
        _now = 0

        def step(self, step: int) -> Any:
            self._now = step
            return super().step(step)

        def _forward_loss(self, batch: Any, optimizer: Any) -> torch.Tensor | None:
            loss = super()._forward_loss(batch, optimizer)  # backward done: gradients reduced
            if self._now == 3 and dist.get_rank() == 1:
                params = dict(unwrap_model(self.p.model).named_parameters())
                grad = params["transformer.h.0.mlp.c_fc.bias"].grad
                grad[0] = float("nan")  # a corrupted gradient, the loss still finite
            return loss

    monkeypatch.setattr(worker, "Trainer", NanGradient)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    out = io.StringIO()
    config = _config(tmp_path, "train.on_nonfinite=skip")
    assert run_worker(config, stream=out, install_signals=False) == 0
    paths = RunPaths.of(str(tmp_path), "run")
    assert _train_steps(paths) == [1, 2, 4, 5, 6, 7, 8]  # both ranks dropped step 3
    assert _all_finite_on_disk(paths) == [6, 8]
    if dist.get_rank() == 0:
        text = out.getvalue()
        assert "step 3: non-finite gradient norm, update skipped" in text, text
        assert "(rank 1: gradient norm nan; every parameter and optimizer tensor is finite" in text
