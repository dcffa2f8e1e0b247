"""The legacy ``Trainer`` on 2 data-parallel ranks (CPU/gloo) vs single-process training on the
global batch: losses every step, parameters at the end, and the metric hooks' values equal to the
ones computed over the whole global batch; a checkpoint saved by the hook loads on every rank."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kolossos
from kolossos.legacy.nn.metric import Accuracy
from kolossos.legacy.utils import load_checkpoint
from kolossos.testing import spawn
from kolossos.testing.parity import (
    TinyMLP,
    assert_moved,
    assert_params_close,
    assert_same_on_all_ranks,
    global_mean,
    make_classification_batches,
    shard,
    snapshot,
)
from kolossos.trainer import Trainer, hooks

EPOCHS = 3
STEPS = 4  # per epoch
TEST_STEPS = 2
GLOBAL_BATCH = 16
LR = 0.4
TOL = 1e-5


class StepLossHook(hooks.BaseHook):
    """Records the mean of the ranks' losses at every step (a collective on every rank)."""

    def __init__(self) -> None:
        super().__init__(priority=50)
        self.losses: list[float] = []
        self.step_metrics: list[dict[str, Any]] = []

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self.losses.append(global_mean(loss))
        self.step_metrics.append(dict(trainer.states["step_metrics"]))


class Messages:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str, ranks: Any = None) -> None:
        self.lines.append(message)


def _reference(model: torch.nn.Module, train: list[Any], test: list[Any]) -> dict[str, Any]:
    """Plain torch on the global batches: per-step losses, the last epoch's test metrics."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.8)
    losses: list[float] = []
    for _ in range(EPOCHS):
        for x, y in train:
            sgd.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            sgd.step()
            sched.step()  # by iteration
            losses.append(loss.item())
    with torch.no_grad():
        outs = [(model(x), y) for x, y in test]
    return {
        "losses": losses,
        "test_loss": sum(F.cross_entropy(o, y).item() for o, y in outs) / len(outs),
        "test_acc": sum(int((o.argmax(-1) == y).sum()) for o, y in outs)
        / (len(outs) * GLOBAL_BATCH),
        "lr": sched.get_last_lr()[0],
    }


def _fit(rank: int, world_size: int, port: int, ckpt: str) -> None:
    kolossos.launch({}, rank, world_size, "localhost", port, verbose=False)
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    initial = snapshot(model)
    train = make_classification_batches(STEPS, GLOBAL_BATCH, seed=1)
    test = make_classification_batches(TEST_STEPS, GLOBAL_BATCH, seed=2)
    local_train = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in train]
    local_test = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in test]
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.8)
    engine, train_loader, test_loader, _ = kolossos.initialize(
        model, sgd, torch.nn.CrossEntropyLoss(), local_train, local_test, verbose=False
    )
    messages = Messages()
    step_hook = StepLossHook()
    loss_hook, acc_hook = hooks.LossHook(), hooks.AccuracyHook(accuracy_func=Accuracy())
    hook_list = [
        step_hook,
        loss_hook,
        acc_hook,
        hooks.LRSchedulerHook(sched, by_epoch=False),
        hooks.LogMetricByEpochHook(messages),  # type: ignore[arg-type]
        hooks.LogMetricByStepHook(),
        hooks.ThroughputHook(),
        hooks.SaveCheckpointHook(EPOCHS, ckpt),
    ]
    trainer = Trainer(engine)
    trainer.fit(train_loader, EPOCHS, test_dataloader=test_loader, test_interval=1,
                hooks=hook_list)  # fmt: skip
    ref = _reference(reference, train, test)

    # training is the single-process training on the global batch
    torch.testing.assert_close(step_hook.losses, ref["losses"], rtol=TOL, atol=TOL)
    assert_params_close(model, reference, rtol=TOL, atol=TOL)
    assert_moved(initial, model, TOL)
    assert_same_on_all_ranks(model)
    # the metrics are the global batch's, on every rank
    last_epoch = ref["losses"][-STEPS:]
    assert loss_hook.train_loss.get_accumulated_value() == pytest.approx(
        sum(last_epoch) / STEPS, rel=TOL, abs=TOL
    )
    assert loss_hook.test_loss.get_accumulated_value() == pytest.approx(
        ref["test_loss"], rel=TOL, abs=TOL
    )
    assert acc_hook.metric.get_accumulated_value() == pytest.approx(ref["test_acc"])
    local_counts = acc_hook.metric.accumulated.tolist()
    assert local_counts[1] == TEST_STEPS * GLOBAL_BATCH // world_size  # this rank's samples
    steps_loss = [m["loss"] for m in step_hook.step_metrics]
    torch.testing.assert_close(steps_loss, ref["losses"], rtol=TOL, atol=TOL)
    assert step_hook.step_metrics[-1]["lr"] == pytest.approx(ref["lr"])
    # logged once per epoch, on rank 0 only
    if rank == 0:
        assert [m.split(":")[0] for m in messages.lines] == [
            f"[Epoch {e} / {kind}]" for e in range(EPOCHS) for kind in ("Train", "Test")
        ]
        acc_text = messages.lines[-1].split("Accuracy = ")[1].split(" ")[0]
        assert float(acc_text) == pytest.approx(ref["test_acc"], abs=1e-4)
    else:
        assert messages.lines == []
    # the checkpoint written by rank 0 loads on every rank
    fresh = TinyMLP()
    assert load_checkpoint(Path(ckpt), fresh) == EPOCHS - 1
    assert_params_close(fresh, model, rtol=0, atol=0)


@pytest.mark.dist
def test_trainer_matches_single_process(tmp_path: Path) -> None:
    spawn(_fit, 2, ckpt=str(tmp_path / "trainer.pt"))
