"""The training loop over the Booster: steps, evaluation, metrics, checkpoints, clean stops.

Every rank runs the same sequence of collectives: one all-reduce per step (the mean loss and
the "stop" vote, so that a Ctrl-C seen by any rank stops all of them after the same step), one
all-gather of memory per logged step, the evaluation all-reduce, and the checkpoint's barriers.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from kolossos.trainer.checkpoints import Checkpointer
from kolossos.trainer.metrics import MetricsLog
from kolossos.trainer.progress import ProgressBar
from kolossos.trainer.schema import config_to_dict
from kolossos.trainer.setup import RunParts

__all__ = ["RunResult", "StopFlag", "Trainer"]


@dataclass
class StopFlag:
    """Set by signal handlers; :attr:`requested` is read once per step, at its end."""

    signal: int | None = None
    """The first signal received, or ``None``."""

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signal is not None


@dataclass
class RunResult:
    """How a run ended."""

    interrupted: bool
    """Stopped early by a signal (on any rank)."""
    step: int
    """Optimizer steps done."""
    start_step: int
    """Steps done when this process started (0, or the resumed checkpoint's step)."""
    last_checkpoint: Path | None
    """The newest complete checkpoint."""
    train_time_s: float = 0.0
    """Seconds spent in training steps by this process."""
    peak_mem: list[float] = field(default_factory=list)
    """Peak memory of each rank in bytes."""


def _all_reduce(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor)  # SYNC POINT
    return [float(v) for v in tensor]


def _gather_memory() -> list[float]:
    from kolossos.accelerator import get_accelerator

    mine = torch.tensor([float(get_accelerator().max_memory_allocated())], dtype=torch.float64)
    if not dist.is_initialized():
        return [float(mine)]
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)  # SYNC POINT
    return [float(t) for t in out]


class Trainer:
    """Runs steps ``start+1 .. train.steps`` of one rank.

    Args:
        parts: what :func:`kolossos.trainer.setup.build_run` built.
        stop: the flag the signal handlers set.
        stream: where rank 0 draws progress (default stdout); ``live`` forces in-place redraws.
    """

    def __init__(
        self,
        parts: RunParts,
        stop: StopFlag,
        stream: TextIO | None = None,
        live: bool | None = None,
    ) -> None:
        self.p = parts
        self.cfg = parts.config
        self.stop = stop
        self.stream = stream
        self.live = live
        self.device = parts.booster.device
        self.checkpointer = Checkpointer(
            parts.booster,
            parts.model,
            parts.optimizer,
            parts.lr_scheduler,
            parts.paths,
            self.cfg.checkpoint.keep_last,
        )
        t = self.cfg.train
        self.tokens_per_step = t.batch_size * self.cfg.model.block_size
        self.val = parts.corpus.val_batches(
            seed=self.cfg.seed,
            count=t.eval_batches,
            batch_size=t.batch_size,
            block=self.cfg.model.block_size,
        )
        self.metrics: MetricsLog | None = None
        self.bar: ProgressBar | None = None

    def say(self, text: str) -> None:
        """Print a message on rank 0."""
        if self.bar is not None:
            self.bar.message(text)

    # ------------------------------------------------------------------ one step
    def _forward_loss(self, batch: dict[str, torch.Tensor], optimizer: Any) -> torch.Tensor | None:
        p = self.p
        if p.pipeline:
            out = p.booster.execute_pipeline(
                iter([batch]), p.model, p.criterion, optimizer, return_loss=True
            )
            loss = out.get("loss")
            return None if loss is None else loss.detach().float()
        loss = p.criterion(p.model(**batch), batch)
        if optimizer is not None:
            p.booster.backward(loss / self.cfg.train.gradient_accumulation, optimizer)
        return loss.detach().float()

    def step(self, step: int) -> tuple[float, bool]:
        """Train optimizer step ``step``; return the mean loss over ranks and the stop vote."""
        p, t, block = self.p, self.cfg.train, self.cfg.model.block_size
        accum = t.gradient_accumulation
        batch = p.corpus.train_batch(step, seed=self.cfg.seed, batch_size=t.batch_size, block=block)
        rows = batch.view(p.layout.dp_size, accum, p.layout.micro_batch, block)[p.dp_rank]
        total, have = 0.0, 0.0
        for micro in range(accum):
            x = rows[micro].to(self.device)
            last = micro == accum - 1
            with nullcontext() if last else p.booster.no_sync(p.model, p.optimizer):
                loss = self._forward_loss({"input_ids": x, "labels": x}, p.optimizer)
            if loss is not None:
                total, have = total + float(loss) / accum, 1.0
        if t.grad_clip > 0:
            p.optimizer.clip_grad_by_norm(t.grad_clip)
        p.optimizer.step()
        p.optimizer.zero_grad()
        p.lr_scheduler.step()
        loss_sum, count, votes = _all_reduce([total * have, have, float(self.stop.requested)])
        return loss_sum / max(count, 1.0), votes > 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches (all ranks)."""
        p, block = self.p, self.cfg.model.block_size
        per_rank = self.cfg.train.batch_size // p.layout.dp_size
        p.model.eval()
        total, count = 0.0, 0.0
        for batch in self.val:
            x = batch.view(p.layout.dp_size, per_rank, block)[p.dp_rank].to(self.device)
            loss = self._forward_loss({"input_ids": x, "labels": x}, None)
            if loss is not None:
                total, count = total + float(loss), count + 1
        p.model.train()
        loss_sum, n = _all_reduce([total, count])
        return loss_sum / max(n, 1.0)

    # ------------------------------------------------------------------ the run
    def _record(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def _resume(self, resume: bool) -> tuple[int, dict[str, Any]]:
        if not resume:
            return 0, {}
        latest = self.checkpointer.latest()
        if latest is None:
            self.say(f"no checkpoint in {self.p.paths.checkpoints}; starting from step 0")
            return 0, {}
        state = self.checkpointer.load(latest[1])
        self.say(f"resumed from {latest[1]} (step {latest[0]})")
        return latest[0], state

    def _begin(self, resume: bool) -> tuple[int, float]:
        """Set up rank 0's progress and metrics, resume if asked, evaluate a fresh model."""
        t, p = self.cfg.train, self.p
        if p.rank == 0:
            self.bar = ProgressBar(t.steps, 0, t.log_interval, self.stream, self.live)
        start, state = self._resume(resume)
        if p.rank == 0:
            self.metrics = MetricsLog(p.paths.metrics, start if resume else None)
            assert self.bar is not None
            self.bar.start = start
            seen = self.metrics.series("val", "val_loss")
            self.bar.val_loss = seen[-1][1] if seen else None
        if start == 0:
            self._evaluate_and_record(0)
        return start, float(state.get("elapsed_s", 0.0))

    def _evaluate_and_record(self, step: int) -> None:
        val = self.evaluate()
        self._record({"kind": "val", "step": step, "val_loss": val})
        if self.bar is not None:
            self.bar.val_loss = val
            self.say(f"step {step}: validation loss {val:.4f}")

    def _log_step(self, step: int, loss: float, lr: float, took: float, elapsed: float) -> None:
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": self.tokens_per_step / max(took, 1e-9),
            "elapsed_s": elapsed,
        }
        if step % self.cfg.train.log_interval == 0 or step == self.cfg.train.steps:
            record["mem_bytes"] = _gather_memory()  # collective: every rank logs the same steps
            if self.bar is not None:
                self.bar.mem = record["mem_bytes"]
        self._record(record)
        if self.bar is not None:
            self.bar.update(step, loss, record["tokens_per_s"])

    def _save(self, step: int, elapsed: float) -> Path:
        state = {
            "elapsed_s": elapsed,
            "config": config_to_dict(self.cfg),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
        folder = self.checkpointer.save(step, state)
        self.say(f"step {step}: saved checkpoint {folder}")
        return folder

    def run(self, resume: bool = False) -> RunResult:
        """Train to ``train.steps`` (or until stopped); evaluate, log and checkpoint on the way."""
        t = self.cfg.train
        start, elapsed0 = self._begin(resume)
        latest = self.checkpointer.latest() if start else None
        result = RunResult(
            interrupted=False,
            step=start,
            start_step=start,
            last_checkpoint=latest[1] if latest else None,
        )
        t0 = time.monotonic()
        for step in range(start + 1, t.steps + 1):
            lr = float(self.p.optimizer.param_groups[0]["lr"])  # the rate this step uses
            began = time.monotonic()
            loss, stop = self.step(step)
            took = time.monotonic() - began
            result.train_time_s += took
            result.step = step
            self._log_step(step, loss, lr, took, elapsed0 + time.monotonic() - t0)
            if stop:
                result.interrupted = True
                break
            if step % t.eval_interval == 0 or step == t.steps:
                self._evaluate_and_record(step)
            if step % self.cfg.checkpoint.every == 0 or step == t.steps:
                result.last_checkpoint = self._save(step, elapsed0 + time.monotonic() - t0)
        if self.bar is not None:
            self.bar.close()
        result.peak_mem = _gather_memory()
        return result
