"""The legacy ``Trainer`` and its hooks in one process, without a process group: the hook
lifecycle and priorities, what each hook records, ``max_steps``, ``evaluate``, resuming, the
progress display and the argument checks. (Metrics over a DATA group: tests/dist.)"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from kolossos.legacy.engine import Engine
from kolossos.legacy.nn.metric import Accuracy, MixupAccuracy
from kolossos.legacy.trainer import Trainer, hooks
from kolossos.legacy.utils import load_checkpoint
from kolossos.nn.lr_scheduler import CosineAnnealingLR
from kolossos.testing.parity import TinyMLP, make_classification_batches, snapshot
from kolossos.utils.timer import MultiTimer

LR = 0.3
BATCH = 8


class RecordHook(hooks.BaseHook):
    """Records every lifecycle call as ``(name, epoch, step)`` and the iterations' losses."""

    def __init__(self, priority: int = 100, tag: str = "") -> None:
        super().__init__(priority)
        self.tag = tag
        self.calls: list[tuple[str, int, int]] = []
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.grad_enabled: list[bool] = []
        self.training: list[bool] = []

    def _rec(self, name: str, trainer: Trainer) -> None:
        self.calls.append((name, trainer.cur_epoch, trainer.cur_step))

    def after_hook_is_attached(self, trainer: Trainer) -> None:
        self._rec("after_hook_is_attached", trainer)

    def before_train(self, trainer: Trainer) -> None:
        self._rec("before_train", trainer)

    def after_train(self, trainer: Trainer) -> None:
        self._rec("after_train", trainer)

    def before_train_epoch(self, trainer: Trainer) -> None:
        self._rec("before_train_epoch", trainer)

    def after_train_epoch(self, trainer: Trainer) -> None:
        self._rec("after_train_epoch", trainer)

    def before_train_iter(self, trainer: Trainer) -> None:
        self._rec("before_train_iter", trainer)

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self._rec("after_train_iter", trainer)
        self.losses.append(float(loss.detach()))
        self.lrs.append(trainer.engine.optimizer.param_groups[0]["lr"])

    def before_test(self, trainer: Trainer) -> None:
        self._rec("before_test", trainer)

    def after_test(self, trainer: Trainer) -> None:
        self._rec("after_test", trainer)

    def before_test_epoch(self, trainer: Trainer) -> None:
        self._rec("before_test_epoch", trainer)

    def after_test_epoch(self, trainer: Trainer) -> None:
        self._rec("after_test_epoch", trainer)

    def before_test_iter(self, trainer: Trainer) -> None:
        self._rec("before_test_iter", trainer)

    def after_test_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self._rec("after_test_iter", trainer)
        self.grad_enabled.append(torch.is_grad_enabled())
        self.training.append(trainer.engine.model.training)


class FakeLogger:
    """Collects what the hooks log."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def info(self, message: str, ranks: Any = None) -> None:
        self.messages.append(message)


def make_engine(seed: int = 0) -> tuple[Engine, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return Engine(model, optimizer, torch.nn.CrossEntropyLoss()), model, optimizer


def loader(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_classification_batches(steps, BATCH, seed=seed)


def names(calls: list[tuple[str, int, int]]) -> list[str]:
    return [c[0] for c in calls]


# ---------------------------------------------------------------- lifecycle and priorities


def test_full_lifecycle_order_with_test_interval() -> None:
    engine, _, _ = make_engine()
    rec = RecordHook()
    Trainer(engine).fit(loader(2), epochs=3, test_dataloader=loader(1, 1), test_interval=2,
                        hooks=[rec])  # fmt: skip
    train_epoch = ["before_train_epoch"]
    train_epoch += ["before_train_iter", "after_train_iter"] * 2 + ["after_train_epoch"]
    test = ["before_test", "before_test_epoch", "before_test_iter", "after_test_iter"]
    test += ["after_test_epoch", "after_test"]
    expected = ["after_hook_is_attached", "before_train"]
    expected += train_epoch + test + train_epoch + train_epoch + test + ["after_train"]
    assert names(rec.calls) == expected  # evaluated after epochs 0 and 2 (index % 2 == 0)
    # the epoch/step counters the hooks see
    after_iters = [(e, s) for n, e, s in rec.calls if n == "after_train_iter"]
    assert after_iters == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]
    epochs_tested = [e for n, e, _ in rec.calls if n == "before_test"]
    assert epochs_tested == [0, 2]
    assert rec.calls[-1] == ("after_train", 3, 6)
    assert all(not g for g in rec.grad_enabled) and not any(rec.training)


def test_hooks_run_by_priority_lower_first_ties_stable() -> None:
    order: list[str] = []

    class Named(hooks.BaseHook):
        def __init__(self, priority: int, name: str) -> None:
            super().__init__(priority)
            self.name = name

        def before_train(self, trainer: Trainer) -> None:
            order.append(self.name)

    given = [Named(5, "a"), Named(1, "b"), Named(5, "c"), Named(0, "d"), Named(1, "e")]
    engine, _, _ = make_engine()
    trainer = Trainer(engine)
    trainer.fit(loader(1), epochs=1, hooks=given)
    assert order == ["d", "b", "e", "a", "c"]
    assert [h.name for h in trainer.hooks] == order  # type: ignore[attr-defined]
    assert [h.name for h in given] == ["a", "b", "c", "d", "e"]  # the caller's list is untouched


def test_documented_default_priorities() -> None:
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=1), 1)
    assert hooks.LossHook().priority == 0
    assert hooks.AccuracyHook(Accuracy()).priority == 0
    assert hooks.LRSchedulerHook(sched, by_epoch=True).priority == 1
    assert hooks.LogMetricByEpochHook(FakeLogger()).priority == 10  # type: ignore[arg-type]
    assert hooks.ThroughputHook().priority == 10
    assert hooks.SaveCheckpointHook(1, "x.pt").priority == 10


# ---------------------------------------------------------------- training is the engine loop


def test_fit_trains_like_the_hand_written_engine_loop() -> None:
    engine, model, _ = make_engine()
    reference = copy.deepcopy(model)
    batches = loader(3)
    rec = RecordHook()
    loss_hook = hooks.LossHook()
    Trainer(engine).fit(batches, epochs=2, hooks=[loss_hook, rec])
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    expected = []
    for _ in range(2):
        for x, y in batches:
            sgd.zero_grad()
            loss = torch.nn.functional.cross_entropy(reference(x), y)
            loss.backward()
            sgd.step()
            expected.append(loss.item())
    torch.testing.assert_close(rec.losses, expected, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    # LossHook: the mean of the last epoch's losses; per step: the last loss
    assert loss_hook.train_loss.get_accumulated_value() == pytest.approx(
        sum(expected[3:]) / 3, rel=1e-6
    )
    assert loss_hook.train_loss.get_last_step_value() == pytest.approx(expected[-1], rel=1e-6)


def test_loss_and_accuracy_hooks_on_evaluate() -> None:
    engine, model, _ = make_engine()
    before = snapshot(model)
    test_batches = loader(3, seed=5)
    rec = RecordHook()
    loss_hook, acc_hook = hooks.LossHook(), hooks.AccuracyHook(accuracy_func=Accuracy())
    trainer = Trainer(engine)
    trainer.evaluate(test_batches, hooks=[acc_hook, loss_hook, rec])
    with torch.no_grad():
        outs = [(model(x), y) for x, y in test_batches]
    correct = sum(int((o.argmax(-1) == y).sum()) for o, y in outs)
    mean_loss = sum(torch.nn.functional.cross_entropy(o, y).item() for o, y in outs) / 3
    metrics = trainer.states["metrics"]["test"]
    assert set(metrics) == {"Loss", "Accuracy"}
    assert metrics["Accuracy"].get_accumulated_value() == pytest.approx(correct / (3 * BATCH))
    assert acc_hook.metric.accumulated.tolist() == [correct, 3 * BATCH]  # counts, not rates
    assert metrics["Loss"].get_accumulated_value() == pytest.approx(mean_loss, rel=1e-6)
    assert names(rec.calls)[1:3] == ["before_test", "before_test_epoch"]
    assert not any(rec.grad_enabled) and not any(rec.training)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"evaluate changed {name}"


def test_accuracy_hook_needs_output_and_label() -> None:
    engine, _, _ = make_engine()
    with pytest.raises(RuntimeError, match="return_output_label=True"):
        Trainer(engine).evaluate(loader(1), hooks=[hooks.AccuracyHook(Accuracy())],
                                 return_output_label=False)  # fmt: skip


def test_accuracy_hook_with_mixup_labels() -> None:
    model = torch.nn.Identity()

    def mixup_loss(out: torch.Tensor, targets_a: Any, targets_b: Any, lam: Any) -> torch.Tensor:
        return out.sum() * 0  # the examples' MixupLoss signature; the value does not matter

    engine = Engine(model, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                    mixup_loss)  # fmt: skip
    logits = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    labels = {"targets_a": torch.tensor([0, 0, 1, 1]), "targets_b": torch.tensor([1, 1, 0, 0]),
              "lam": torch.tensor([0.9, 0.2, 0.3, 0.6])}  # fmt: skip
    # dominant targets: a, b, b, a = [0, 1, 0, 1]; predictions [0, 1, 0, 1]: 4 correct
    hook = hooks.AccuracyHook(MixupAccuracy())
    trainer = Trainer(engine)
    trainer.evaluate([(logits, labels)], hooks=[hook])
    assert hook.metric.get_accumulated_value() == 1.0
    as_tuple = (labels["targets_a"], labels["targets_b"], labels["lam"])
    assert int(MixupAccuracy()(logits, as_tuple)) == 4
    assert int(MixupAccuracy()(logits, torch.tensor([[0.2, 0.8]] * 4))) == 2  # soft labels
    with pytest.raises(ValueError, match="targets_a"):
        MixupAccuracy()(logits, {"a": 1})


# ---------------------------------------------------------------- LR scheduler hook


@pytest.mark.parametrize("by_epoch", [True, False])
@pytest.mark.filterwarnings("ignore:Detected call of")
def test_lr_scheduler_hook_matches_hand_stepped_scheduler(by_epoch: bool) -> None:
    engine, _, optimizer = make_engine()
    epochs, steps = 3, 4
    total = epochs if by_epoch else epochs * steps
    sched = CosineAnnealingLR(optimizer, total_steps=total)
    lr_hook = hooks.LRSchedulerHook(sched, by_epoch=by_epoch)
    rec = RecordHook()
    trainer = Trainer(engine)
    trainer.fit(loader(steps), epochs=epochs, hooks=[lr_hook, rec])
    hand = CosineAnnealingLR(torch.optim.SGD([torch.zeros(1)], lr=LR), total_steps=total)
    expected = []  # the rate each optimizer step used
    for _ in range(epochs):
        for _ in range(steps):
            expected.append(hand.get_last_lr()[0])
            if not by_epoch:
                hand.step()
        if by_epoch:
            hand.step()
    # rec runs after the LR hook: with by_epoch=False it sees the rate of the next step
    used = [LR, *rec.lrs[:-1]] if not by_epoch else rec.lrs
    assert used == pytest.approx(expected)
    assert len(set(expected)) > 2  # the schedule really moved
    lr_metric = trainer.states["metrics"]["train"]["LR"]
    assert lr_metric.get_accumulated_value() == pytest.approx(hand.get_last_lr()[0])
    assert lr_metric.epoch_only is by_epoch
    assert sched.last_epoch == hand.last_epoch


def test_lr_scheduler_hook_store_lr_in_state_false_and_bad_arguments() -> None:
    engine, _, optimizer = make_engine()
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    trainer = Trainer(engine)
    trainer.fit(loader(1), epochs=2, hooks=[hooks.LRSchedulerHook(sched, True, False)])
    assert "LR" not in trainer.states["metrics"]["train"]
    assert sched.get_last_lr()[0] == pytest.approx(LR * 0.25)
    with pytest.raises(TypeError, match="by_epoch must be True"):
        hooks.LRSchedulerHook(sched, by_epoch="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="get_last_lr"):
        hooks.LRSchedulerHook(optimizer, by_epoch=True)


# ---------------------------------------------------------------- throughput and logging


def test_throughput_hook_counts_samples_and_time() -> None:
    engine, _, _ = make_engine()
    hook = hooks.ThroughputHook(ignored_steps=1)
    trainer = Trainer(engine)
    trainer.fit(loader(4), epochs=1, hooks=[hook, hooks.LogMetricByStepHook()])
    samples, seconds = hook.metric.accumulated.tolist()
    assert samples == 3 * BATCH and seconds > 0  # the first step is ignored
    assert hook.metric.get_accumulated_value() == pytest.approx(samples / seconds, rel=1e-6)
    assert trainer.states["step_metrics"]["throughput"].endswith("sample_per_sec")
    with pytest.raises(ValueError, match="ignored_steps"):
        hooks.ThroughputHook(ignored_steps=-1)


def test_log_metric_hooks_write_through_the_logger() -> None:
    engine, _, optimizer = make_engine()
    logger = FakeLogger()
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    hook_list = [
        hooks.LossHook(),
        hooks.LRSchedulerHook(sched, by_epoch=True),
        hooks.AccuracyHook(Accuracy()),
        hooks.LogMetricByEpochHook(logger, interval=2),  # type: ignore[arg-type]
        hooks.LogMetricByStepHook(),
    ]
    trainer = Trainer(engine)
    trainer.fit(loader(2), epochs=3, test_dataloader=loader(2, 3), hooks=hook_list)
    train = [m for m in logger.messages if "/ Train]" in m]
    test = [m for m in logger.messages if "/ Test]" in m]
    assert [m.split(":")[0] for m in train] == ["[Epoch 0 / Train]", "[Epoch 2 / Train]"]
    assert [m.split(":")[0] for m in test] == ["[Epoch 0 / Test]", "[Epoch 2 / Test]"]
    assert "Loss = " in train[0] and "LR = 0.15" in train[0]  # LR after the epoch's step
    assert "Loss = " in test[0] and " | Accuracy = " in test[0]
    assert set(trainer.states["step_metrics"]) == {"loss", "accuracy"}  # the last: a test step
    with pytest.raises(ValueError, match="interval"):
        hooks.LogMetricByEpochHook(logger, interval=0)  # type: ignore[arg-type]


def test_log_timing_and_memory_hooks() -> None:
    engine, _, _ = make_engine()
    logger = FakeLogger()
    timer = MultiTimer()
    trainer = Trainer(engine, timer=timer)
    trainer.fit(loader(2), epochs=2, test_dataloader=loader(1, 2), hooks=[
        hooks.LogTimingByEpochHook(timer, logger, ignore_num_train_steps=1),  # type: ignore[arg-type]
        hooks.LogMemoryByEpochHook(logger),  # type: ignore[arg-type]
    ])  # fmt: skip
    timing = [m for m in logger.messages if "Train-step" in m or "Test-step" in m]
    assert len(timing) == 4, logger.messages
    assert "Train-step: last = " in timing[0] and "mean = " in timing[0]
    assert "#steps/epoch = 2" in timing[0]
    assert timing[1].startswith("[Epoch 0 / Test]: Test-")
    memory = [m for m in logger.messages if " MB" in m and "step" not in m]
    prefixes = [m.split(":")[0] for m in memory]
    assert prefixes == ["Before-train", "[Epoch 0 / Train]", "[Epoch 0 / Test]",
                        "[Epoch 1 / Train]", "[Epoch 1 / Test]"]  # fmt: skip
    assert "current" in memory[0] or "allocated" in memory[0]
    other = Trainer(make_engine()[0], timer=MultiTimer())
    with pytest.raises(ValueError, match="same MultiTimer"):
        other.fit(loader(1), epochs=1, hooks=[hooks.LogTimingByEpochHook(timer, logger)])  # type: ignore[arg-type]


# ---------------------------------------------------------------- checkpoints


def test_save_checkpoint_hook_every_interval_epochs(tmp_path: Path) -> None:
    engine, model, optimizer = make_engine()
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)

    class Snap(hooks.BaseHook):
        def __init__(self) -> None:
            super().__init__(priority=20)  # after the save
            self.params: dict[int, dict[str, torch.Tensor]] = {}

        def after_train_epoch(self, trainer: Trainer) -> None:
            self.params[trainer.cur_epoch] = snapshot(model)

    snap = Snap()
    ckpt = hooks.SaveCheckpointHook(interval=2, checkpoint_dir=tmp_path / "ckpt")
    Trainer(engine).fit(loader(2), epochs=4, hooks=[ckpt, hooks.LRSchedulerHook(sched, True), snap])
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["epoch1.pt", "epoch3.pt"]  # after the 2nd and the 4th epoch
    fresh, _, fresh_opt = make_engine(seed=1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5)
    epoch = load_checkpoint(tmp_path / "ckpt" / "epoch1.pt", fresh.model, fresh.optimizer,
                            fresh_sched)  # fmt: skip
    assert epoch == 1
    for name, p in fresh.model.named_parameters():
        assert torch.equal(p, snap.params[1][name]), name
    assert fresh_sched.get_last_lr()[0] == pytest.approx(LR * 0.25)  # the LR hook's scheduler


def test_save_checkpoint_hook_positional_file_and_by_iter(tmp_path: Path) -> None:
    engine, model, _ = make_engine()
    other = TinyMLP()
    hook = hooks.SaveCheckpointHook(1, str(tmp_path / "xxx.pt"), model)
    by_iter = hooks.SaveCheckpointHook(3, tmp_path / "iters", save_by_iter=True)
    Trainer(engine).fit(loader(4), epochs=2, hooks=[hook, by_iter])
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["xxx.pt"]
    assert load_checkpoint(tmp_path / "xxx.pt", other) == 1  # overwritten: the last epoch
    for (name, p), q in zip(other.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert sorted(p.name for p in (tmp_path / "iters").iterdir()) == ["step3.pt", "step6.pt"]
    with pytest.raises(ValueError, match="checkpoint_dir"):
        hooks.SaveCheckpointHook(1)
    with pytest.raises(ValueError, match="interval must be an integer >= 1"):
        hooks.SaveCheckpointHook(0, "x.pt")


# ---------------------------------------------------------------- tensorboard


class FakeWriter:
    instances: ClassVar[list[FakeWriter]] = []

    def __init__(self, log_dir: str, filename_suffix: str = "") -> None:
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int]] = []
        FakeWriter.instances.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass


def test_tensorboard_hook_writes_metrics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeWriter.instances.clear()
    engine, _, optimizer = make_engine()
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    tb = hooks.TensorboardHook(log_dir=tmp_path / "tb", ranks=[0])
    Trainer(engine).fit(loader(2), epochs=2, test_dataloader=loader(1, 4), hooks=[
        hooks.LossHook(), hooks.LRSchedulerHook(sched, by_epoch=True), tb])  # fmt: skip
    (writer,) = FakeWriter.instances
    assert Path(writer.log_dir).parent == tmp_path / "tb"
    tags = [(tag, step) for tag, _, step in writer.scalars]
    epoch0 = [("Loss/train", 0), ("Loss/train", 1), ("LR/train", 2), ("Loss/test", 2)]
    epoch1 = [("Loss/train", 2), ("Loss/train", 3), ("LR/train", 4), ("Loss/test", 4)]
    assert tags == epoch0 + epoch1
    assert writer.scalars[2][1] == pytest.approx(LR * 0.5)


def test_tensorboard_hook_event_files_or_clear_message(tmp_path: Path) -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            hooks.TensorboardHook(log_dir=tmp_path)
        return
    engine, _, _ = make_engine()
    tb = hooks.TensorboardHook(log_dir=tmp_path, ranks=[0])
    Trainer(engine).fit(loader(2), epochs=1, hooks=[hooks.LossHook(), tb])
    assert list(tmp_path.rglob("events.out.tfevents.*"))


# ---------------------------------------------------------------- max_steps, resume, progress


def test_max_steps_stops_early_and_still_evaluates() -> None:
    engine, _, _ = make_engine()
    rec = RecordHook()
    logger = FakeLogger()
    trainer = Trainer(engine, logger=logger)  # type: ignore[arg-type]
    trainer.fit(loader(4), epochs=3, max_steps=6, test_dataloader=loader(1, 1), hooks=[rec])
    assert trainer.cur_step == 6 and trainer.cur_epoch == 2
    assert names(rec.calls).count("after_train_iter") == 6
    assert names(rec.calls).count("before_test") == 2  # the cut epoch is evaluated too
    assert names(rec.calls)[-1] == "after_train"
    assert any("Max number of steps 6" in m for m in logger.messages)
    assert any("Using RecordHook for training, priority = 100" in m for m in logger.messages)


def test_resume_from_cur_epoch_and_sampler_epochs() -> None:
    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    class Loader(list):  # type: ignore[type-arg]
        sampler = Sampler()

    engine, _, _ = make_engine()
    data = Loader(loader(3))
    rec = RecordHook()
    trainer = Trainer(engine)
    trainer.cur_epoch = 2
    trainer.fit(data, epochs=4, hooks=[rec])
    assert [(e, s) for n, e, s in rec.calls if n == "before_train_epoch"] == [(2, 6), (3, 9)]
    assert data.sampler.epochs == [2, 3]
    assert trainer.max_epochs == 4 and trainer.steps_per_epoch == 3 and trainer.cur_step == 12
    with pytest.warns(UserWarning, match="nothing is trained"):
        trainer.fit(data, epochs=4)


def test_progress_display_tqdm_and_plain(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine, _, _ = make_engine()
    trainer = Trainer(engine)
    hook_list = [hooks.LossHook(), hooks.LogMetricByStepHook()]
    trainer.fit(loader(2), epochs=1, test_dataloader=loader(1), hooks=hook_list,
                display_progress=True)  # fmt: skip
    err = capsys.readouterr().err
    assert "[Epoch 0 / Train]" in err and "[Epoch 0 / Test]" in err
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    trainer.cur_epoch = 0
    trainer.fit(loader(2), epochs=1, hooks=hook_list, display_progress=True)
    err = capsys.readouterr().err
    assert "[Epoch 0 / Train]: 2/2 loss=" in err
    trainer.cur_epoch = 0
    trainer.fit(loader(2), epochs=1, hooks=hook_list, display_progress=False)
    assert "[Epoch" not in capsys.readouterr().err


def test_predict_returns_the_model_output() -> None:
    engine, model, _ = make_engine()
    x = torch.randn(3, 16)
    torch.testing.assert_close(Trainer(engine).predict(x), model(x))


# ---------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(epochs=0), ValueError, r"epochs=0\): epochs must be an integer >= 1"),
        (dict(epochs=1.5), ValueError, "epochs must be an integer"),
        (dict(epochs=1, max_steps=0), ValueError, "max_steps must be an integer >= 1 or None"),
        (dict(epochs=1, test_interval=0), ValueError, "test_interval must be an integer >= 1"),
        (dict(epochs=1, hooks=[hooks.LossHook]), TypeError, r"LossHook\(\), not LossHook"),
        (dict(epochs=1, hooks=[object()]), TypeError, r"hooks\[0\] is a object, not a BaseHook"),
        (dict(epochs=1, hooks=hooks.LossHook()), TypeError, "hooks must be a list"),
        (dict(epochs=1, test_dataloader=[]), ValueError, "test_dataloader is empty"),
    ],
)
def test_fit_rejects_bad_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    engine, _, _ = make_engine()
    with pytest.raises(error, match=match):
        Trainer(engine).fit(loader(1), **kwargs)


def test_bad_dataloaders_engine_timer_and_warnings() -> None:
    engine, model, _ = make_engine()
    trainer = Trainer(engine)
    with pytest.raises(ValueError, match="train_dataloader is empty"):
        trainer.fit([], epochs=1)
    with pytest.raises(TypeError, match="has no len"):
        trainer.fit(iter(loader(1)), epochs=1)
    with pytest.raises(RuntimeError, match="ran out of batches"):

        class Short(list):  # type: ignore[type-arg]
            def __len__(self) -> int:
                return 5

        trainer.fit(Short(loader(2)), epochs=1)
    with pytest.raises(TypeError, match=r"kolossos\.initialize"):
        Trainer(model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MultiTimer"):
        Trainer(engine, timer=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority must be a number"):
        hooks.BaseHook("high")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="no effect without a test_dataloader"):
        trainer.cur_epoch = 0
        trainer.fit(loader(1), epochs=1, test_interval=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.cur_epoch = 0
        trainer.fit(loader(1), epochs=1)  # the defaults warn about nothing


def test_import_paths() -> None:
    import kolossos.trainer.hooks as alias_hooks
    from kolossos.nn.metric import Accuracy as AliasAccuracy
    from kolossos.trainer import Trainer as AliasTrainer
    from kolossos.trainer import hooks as alias_pkg
    from kolossos.trainer.hooks import LossHook

    assert AliasTrainer is Trainer and LossHook is hooks.LossHook
    assert alias_pkg is alias_hooks
    for name in hooks.__all__:
        assert getattr(alias_hooks, name) is getattr(hooks, name), name
    assert AliasAccuracy is Accuracy
    from kolossos.legacy.registry import HOOKS

    assert HOOKS.get_module("LRSchedulerHook") is hooks.LRSchedulerHook
