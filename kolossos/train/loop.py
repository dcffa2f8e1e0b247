"""The training loop over the Booster: steps, evaluation, metrics, checkpoints, clean stops.

Every rank runs the same sequence of collectives: one all-reduce per step (the mean loss, the
"stop" vote, so that a Ctrl-C seen by any rank stops all of them after the same step, and the
non-finite vote, taken before the optimizer steps), one all-gather of memory per logged step,
the evaluation all-reduce, the checkpoint's finite check and barriers, and while an
asynchronous checkpoint is written, one small all-reduce per step asking whether it is done.

Non-finite values (``train.on_nonfinite``): a non-finite loss on any rank, or a non-finite
gradient norm (checked when ``train.grad_clip`` computes it; in fp16 an inf norm is an overflow
the loss scaler handles), is decided by all ranks before the optimizer steps. ``stop`` ends the
run with the step, the ranks and the first non-finite tensor; ``skip`` drops that step's update
(when the weights are still finite); ``rollback`` reloads the latest checkpoint and replays from
it without the offending steps. No checkpoint is written while any tensor to be saved is
non-finite, so rotation never removes the last finite one.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from kolossos.train.checkpoints import Checkpointer
from kolossos.train.metrics import MetricsLog
from kolossos.train.numerics import (
    NonFiniteError,
    any_rank,
    first_nonfinite,
    gather_offenders,
    is_finite,
    local_tensors,
)
from kolossos.train.packed import IGNORE_INDEX, PackedCorpus
from kolossos.train.progress import ProgressBar
from kolossos.train.schema import config_to_dict
from kolossos.train.setup import RunParts

__all__ = ["MAX_ROLLBACKS", "RunResult", "StepOutcome", "StopFlag", "Trainer"]

#: rollbacks one run may make before a non-finite loss stops it
MAX_ROLLBACKS = 3


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
    skipped: list[int] = field(default_factory=list)
    """Steps whose update was dropped for a non-finite loss (``skip``, ``rollback``)."""
    rollbacks: int = 0
    """Times the run went back to a checkpoint (``rollback``)."""


@dataclass(frozen=True)
class StepOutcome:
    """What one training step decided, the same on every rank."""

    loss: float
    """The mean loss over ranks (non-finite when ``nonfinite``)."""
    stop: bool
    """Some rank asked to stop (a signal)."""
    nonfinite: bool
    """Some rank's loss, or the gradient norm, was inf or NaN: the optimizer did not step."""
    what: str = "loss"
    """What was non-finite: ``"loss"`` or ``"gradient norm"``."""


Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _pair(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of a batch; a plain tensor is its own labels (every token is
    trained on; the model shifts them)."""
    return batch if isinstance(batch, tuple) else (batch, batch)


def _pairs(batches: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids, labels = _pair(batches)
    return list(zip(ids, labels, strict=True))


def _all_reduce(values: list[float]) -> list[float]:
    from kolossos.cluster.collectives import comm_device

    tensor = torch.tensor(values, dtype=torch.float64, device=comm_device())  # NCCL: the GPU
    if dist.is_initialized():
        dist.all_reduce(tensor)  # SYNC POINT
    return [float(v) for v in tensor.tolist()]


def _gather_memory() -> list[float]:
    from kolossos.accelerator import get_accelerator
    from kolossos.cluster.collectives import comm_device

    peak = float(get_accelerator().max_memory_allocated())
    mine = torch.tensor([peak], dtype=torch.float64, device=comm_device())
    if not dist.is_initialized():
        return [float(mine)]
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)  # SYNC POINT
    return [float(t.item()) for t in out]


class Trainer:
    """Runs steps ``start+1 .. train.steps`` of one rank.

    Args:
        parts: what :func:`kolossos.train.setup.build_run` built.
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
            asynchronous=self.cfg.checkpoint.async_,
        )
        t = self.cfg.train
        self.tokens_per_step = t.batch_size * self.cfg.model.block_size
        self.val = _pairs(
            parts.corpus.val_batches(
                seed=self.cfg.seed,
                count=t.eval_batches,
                batch_size=t.batch_size,
                block=self.cfg.model.block_size,
            )
        )
        self.metrics: MetricsLog | None = None
        self.bar: ProgressBar | None = None
        self._bad_norm: float | None = None  # the non-finite gradient norm of this step

    def say(self, text: str) -> None:
        """Print a message on rank 0."""
        if self.bar is not None:
            self.bar.message(text)

    # ------------------------------------------------------------------ one step
    def _forward_loss(
        self, batch: dict[str, torch.Tensor], optimizer: Any, weight: float = 1.0
    ) -> torch.Tensor | None:
        """The (weighted) loss of one micro-batch, after its backward when ``optimizer`` is
        given; ``None`` on pipeline ranks without the last stage."""
        p = self.p
        if p.pipeline:
            out = p.booster.execute_pipeline(
                iter([batch]), p.model, p.criterion, optimizer, return_loss=True
            )
            loss = out.get("loss")
            return None if loss is None else loss.detach().float()
        loss = p.criterion(p.model(**batch), batch)
        if weight != 1.0:
            loss = loss * weight
        if optimizer is not None:
            p.booster.backward(loss / self.cfg.train.gradient_accumulation, optimizer)
        return loss.detach().float()

    def _weights(self, labels: torch.Tensor) -> torch.Tensor | None:
        """Per micro-batch loss weights that make the mean over micro-batches (and ranks) the
        mean over every trained token of the global batch: with masked prompts the micro-batches
        hold different numbers of targets. ``labels`` is ``(..., rows, block)``; the weights are
        ``(...)``. ``None`` (all ones) for the original corpus, where every token is a target,
        and with a pipeline, whose schedule averages its micro-batches itself."""
        if self.p.pipeline or not isinstance(self.p.corpus, PackedCorpus):
            return None
        targets = (labels[..., 1:] != IGNORE_INDEX).sum(dim=(-1, -2)).double()
        return targets * targets.numel() / targets.sum().clamp(min=1.0)

    def step(self, step: int) -> StepOutcome:
        """Train optimizer step ``step``; the ranks agree on the mean loss, the stop vote and
        whether any loss (or, with ``train.grad_clip``, the gradient norm) was non-finite before
        the optimizer steps (then it does not)."""
        p, t, block = self.p, self.cfg.train, self.cfg.model.block_size
        accum = t.gradient_accumulation
        ids, labels = _pair(
            p.corpus.train_batch(step, seed=self.cfg.seed, batch_size=t.batch_size, block=block)
        )
        shape = (p.layout.dp_size, accum, p.layout.micro_batch, block)
        rows, row_labels = ids.view(shape)[p.dp_rank], labels.view(shape)[p.dp_rank]
        weights = self._weights(labels.view(shape))
        total, have = 0.0, 0.0
        for micro in range(accum):
            x, y = rows[micro].to(self.device), row_labels[micro].to(self.device)
            last = micro == accum - 1
            # (the weight only when there is one: subclasses may override the 2-argument form)
            weight = () if weights is None else (float(weights[p.dp_rank, micro]),)
            with nullcontext() if last else p.booster.no_sync(p.model, p.optimizer):
                loss = self._forward_loss({"input_ids": x, "labels": y}, p.optimizer, *weight)
            if loss is not None:
                total, have = total + float(loss) / accum, 1.0
        bad_here = have > 0 and not is_finite(total)
        bad_norm = False
        if t.grad_clip > 0:  # (a collective for sharded plugins: every rank clips)
            norm = float(p.optimizer.clip_grad_by_norm(t.grad_clip))
            # fp16: an inf norm is an overflow, which the loss scaler skips as always
            bad_norm = not is_finite(norm) and self.cfg.mixed_precision != "fp16"
            if bad_norm:  # (clipping by a non-finite norm made every gradient non-finite)
                self._bad_norm = norm
        loss_sum, count, votes, bad, bad_grads = _all_reduce(
            [
                0.0 if bad_here else total * have,
                have,
                float(self.stop.requested),
                float(bad_here),
                float(bad_norm),
            ]
        )
        if bad > 0 or bad_grads > 0:  # every rank decides the same
            p.optimizer.zero_grad()
            if bad > 0:
                return StepOutcome(float("nan"), votes > 0, True)
            return StepOutcome(loss_sum / max(count, 1.0), votes > 0, True, "gradient norm")
        p.optimizer.step()
        p.optimizer.zero_grad()
        p.lr_scheduler.step()
        return StepOutcome(loss_sum / max(count, 1.0), votes > 0, False)

    def _offenders(self) -> tuple[bool, str]:
        """Whether any rank holds a non-finite tensor, and each such rank's first one described
        (a collective)."""
        found = gather_offenders(first_nonfinite(local_tensors(self.p.model, self.p.optimizer)))
        norm, self._bad_norm = self._bad_norm, None
        norms = gather_offenders(None if norm is None else str(norm))
        if not found:
            where = "every parameter and optimizer tensor is finite: forward or backward made it"
            if norms:
                where = "; ".join(f"rank {r}: gradient norm {n}" for r, n in norms) + "; " + where
            return False, where
        return True, "; ".join(
            f"rank {rank}: first non-finite tensor {name}" for rank, name in found
        )

    def evaluate(self) -> float:
        """Mean validation loss over the fixed validation batches (all ranks), without
        gradients (a pipeline runs its forward-only mode under ``torch.no_grad()``)."""
        p, block = self.p, self.cfg.model.block_size
        per_rank = self.cfg.train.batch_size // p.layout.dp_size
        p.model.eval()
        total, count = 0.0, 0.0
        shape = (len(self.val), p.layout.dp_size, per_rank, block)
        weights = self._weights(torch.stack([labels for _, labels in self.val]).view(shape))
        with torch.no_grad():
            for i, (batch, batch_labels) in enumerate(self.val):
                x = batch.view(shape[1:])[p.dp_rank].to(self.device)
                y = batch_labels.view(shape[1:])[p.dp_rank].to(self.device)
                weight = () if weights is None else (float(weights[i, p.dp_rank]),)
                loss = self._forward_loss({"input_ids": x, "labels": y}, None, *weight)
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
            scalars = None
            if self.cfg.metrics.tensorboard:
                from kolossos.train.metrics import tensorboard_writer

                purge = start + 1 if resume and start else None
                scalars = tensorboard_writer(p.paths.root / "tensorboard", purge)
            self.metrics = MetricsLog(p.paths.metrics, start if resume else None, scalars)
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

    def _save(self, step: int, elapsed: float) -> Path | None:
        mine = first_nonfinite(local_tensors(self.p.model, self.p.optimizer))
        if any_rank(mine is not None):  # SYNC POINT: never write a non-finite checkpoint
            found = "; ".join(f"rank {r}: {n}" for r, n in gather_offenders(mine))
            raise NonFiniteError(
                f"step {step}: not writing the checkpoint: it would hold non-finite tensors "
                f"({found}). The previous checkpoints are kept; lower train.lr or set "
                "train.on_nonfinite='rollback'.",
                step,
            )
        state = {
            "elapsed_s": elapsed,
            "config": config_to_dict(self.cfg),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
        folder = self.checkpointer.save(step, state)
        if folder is None:
            self.say(f"step {step}: writing the checkpoint in the background")
        else:
            self.say(f"step {step}: saved checkpoint {folder}")
        return folder

    def _completed(self, result: RunResult, folder: Path | None) -> None:
        """Note a checkpoint that became complete in the background."""
        if folder is not None:
            result.last_checkpoint = folder
            self.say(f"checkpoint complete: {folder}")

    def run(self, resume: bool = False) -> RunResult:
        """Train to ``train.steps`` (or until stopped); evaluate, log and checkpoint on the way.

        Raises:
            NonFiniteError: a non-finite loss with ``on_nonfinite='stop'`` (or one that ``skip``
                and ``rollback`` cannot handle), on every rank at the same step.
        """
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
        dropped: set[int] = set()  # steps replayed without their update after a rollback
        step = start + 1
        while step <= t.steps:
            if step in dropped:  # SYNC: every rank drops the same steps
                self.say(f"step {step}: skipped (its loss was not finite before the rollback)")
                step += 1
                continue
            lr = float(self.p.optimizer.param_groups[0]["lr"])  # the rate this step uses
            began = time.monotonic()
            outcome = self.step(step)
            took = time.monotonic() - began
            result.train_time_s += took
            if outcome.nonfinite:
                step = self._nonfinite(step, outcome, result, dropped)
                continue
            result.step = step
            self._log_step(step, outcome.loss, lr, took, elapsed0 + time.monotonic() - t0)
            self._completed(result, self.checkpointer.poll())
            if outcome.stop:
                result.interrupted = True
                break
            if step % t.eval_interval == 0 or step == t.steps:
                self._evaluate_and_record(step)
            if step % self.cfg.checkpoint.every == 0 or step == t.steps:
                result.last_checkpoint = self._save(step, elapsed0 + time.monotonic() - t0) or (
                    result.last_checkpoint
                )
            step += 1
        self._completed(result, self.checkpointer.flush())
        if self.bar is not None:
            self.bar.close()
        result.peak_mem = _gather_memory()
        return result

    def _nonfinite(
        self, step: int, outcome: StepOutcome, result: RunResult, dropped: set[int]
    ) -> int:
        """Apply ``train.on_nonfinite`` to a non-finite step; return the next step
        to run (collective: every rank decides the same)."""
        policy = self.cfg.train.on_nonfinite
        weights_bad, where = self._offenders()
        self._record({"kind": "nonfinite", "step": step, "policy": policy, "where": where})
        if policy == "skip" and not weights_bad:
            result.skipped.append(step)
            self.say(f"step {step}: non-finite {outcome.what}, update skipped ({where})")
            return step + 1
        if policy == "rollback" and result.rollbacks < MAX_ROLLBACKS:
            self._completed(result, self.checkpointer.flush())  # its tensors were finite
            latest = self.checkpointer.latest()
            if latest is not None:
                self.checkpointer.load(latest[1])
                if self.metrics is not None:
                    self.metrics.rewind(latest[0])
                result.rollbacks += 1
                result.skipped.append(step)
                dropped.add(step)
                self.say(f"step {step}: non-finite {outcome.what} ({where}); rolled back to step "
                         f"{latest[0]}, replaying without step {step}")  # fmt: skip
                return latest[0] + 1
        reason = {
            "stop": "train.on_nonfinite='stop'",
            "skip": "the weights themselves are non-finite, so skipping the update cannot help",
            "rollback": f"no checkpoint to roll back to, or {MAX_ROLLBACKS} rollbacks done",
        }[policy]
        raise NonFiniteError(
            f"step {step}: the {outcome.what} is not finite ({where}); stopped because {reason}. "
            "No checkpoint holds non-finite values; resume from the last one with a lower "
            "train.lr, or set train.on_nonfinite='skip' or 'rollback'.",
            step,
        )
