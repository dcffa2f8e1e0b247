"""The legacy utilities without a process group: timers, the accuracy metric's maths, the data
loader and sampler before any launch, the ``is_using_*`` answers, and the old import paths."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import kolossos.nn as col_nn
import kolossos.utils as utils
from kolossos.legacy.nn.metric import Accuracy, Accuracy2D, Accuracy2p5D, Accuracy3D, calc_acc
from kolossos.legacy.utils import (
    DataParallelSampler,
    get_dataloader,
    is_dp_rank_0,
    is_no_pp_or_last_stage,
    is_tp_rank_0,
    is_using_ddp,
    is_using_pp,
    is_using_sequence,
)
from kolossos.utils.timer import MultiTimer, Timer

# ---------------------------------------------------------------- timers


def test_timer_history_mean_and_sum() -> None:
    timer = Timer()
    assert not timer.has_history
    for _ in range(3):
        timer.start()
        assert timer.lap() >= 0.0
        timer.stop(keep_in_history=True)
    timer.start()
    last = timer.stop()  # not kept
    assert len(timer.history) == 3 and timer.get_elapsed_time() == last
    assert timer.get_history_sum() == pytest.approx(sum(timer.history))
    assert timer.get_history_mean() == pytest.approx(sum(timer.history) / 3)
    timer.reset()
    assert not timer.has_history and timer.get_history_sum() == 0


def test_timer_misuse_is_a_clear_error() -> None:
    timer = Timer()
    with pytest.raises(RuntimeError, match=r"before Timer\.start"):
        timer.stop()
    with pytest.raises(RuntimeError, match="no history"):
        timer.get_history_mean()
    timer.start()
    with pytest.raises(RuntimeError, match="still running"):
        timer.get_elapsed_time()


def test_multi_timer_names_switch_and_reset() -> None:
    timers = MultiTimer()
    timers.start("fwd")
    timers.start("bwd")
    assert isinstance(timers.stop("fwd", keep_in_history=True), float)
    timers.stop("bwd", keep_in_history=True)
    assert [name for name, _ in timers] == ["fwd", "bwd"]
    assert timers.get_timer("fwd").has_history
    timers.reset("fwd")
    assert not timers.get_timer("fwd").has_history and timers.get_timer("bwd").has_history
    timers.reset()
    assert not timers.get_timer("bwd").has_history
    with pytest.raises(KeyError, match="no timer named 'nope'"):
        timers.stop("nope", keep_in_history=False)
    timers.set_status(False)
    assert not timers.is_on()
    timers.start("off")
    assert timers.stop("off", keep_in_history=True) is None
    assert "off" not in dict(iter(timers))


# ---------------------------------------------------------------- metric


def test_calc_acc_counts_correct_predictions() -> None:
    logits = torch.tensor([[0.1, 0.7, 0.2], [0.9, 0.05, 0.05], [0.3, 0.3, 0.4], [1.0, 1.0, 0.0]])
    targets = torch.tensor([1, 2, 2, 0])  # the tie in the last row goes to class 0
    assert calc_acc(logits, targets).item() == 3
    metric = Accuracy()
    assert not metric.parallel_output
    assert metric(logits, targets).item() == 3
    batched = logits.unsqueeze(0).expand(2, -1, -1)  # (batch, seq, classes) works too
    assert metric(batched, targets.expand(2, -1)).item() == 6


def test_accuracy_rejects_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"parallel_output=True\) needs"):
        Accuracy(parallel_output=True)
    for cls, mode in ((Accuracy2D, "2D"), (Accuracy2p5D, "2.5D"), (Accuracy3D, "3D")):
        with pytest.raises(RuntimeError, match=f"{mode} tensor-parallel layers need the {mode}"):
            cls()  # no launch: no process groups of the mode


# ---------------------------------------------------------------- loader without a launch


def _indices(loader: torch.utils.data.DataLoader) -> list[int]:  # type: ignore[type-arg]
    return [int(i) for (batch,) in loader for i in batch]


def test_loader_without_launch_reads_everything() -> None:
    dataset = TensorDataset(torch.arange(10))
    loader = get_dataloader(dataset, batch_size=4)
    assert loader.sampler.__class__.__name__ == "SequentialSampler"
    assert _indices(loader) == list(range(10))
    assert len(list(get_dataloader(dataset, batch_size=4, drop_last=True))) == 2


def test_loader_shuffle_is_seeded_and_reshuffles() -> None:
    dataset = TensorDataset(torch.arange(16))
    first = get_dataloader(dataset, shuffle=True, seed=3, batch_size=4)
    again = get_dataloader(dataset, shuffle=True, seed=3, batch_size=4)
    other = get_dataloader(dataset, shuffle=True, seed=4, batch_size=4)
    epoch0 = _indices(first)
    assert sorted(epoch0) == list(range(16)) and epoch0 != list(range(16))
    assert _indices(again) == epoch0 and _indices(other) != epoch0
    assert _indices(first) != epoch0  # the next pass is a new order


def test_loader_worker_init_fn_runs_after_seeding() -> None:
    seen: list[int] = []
    loader = get_dataloader([1, 2], batch_size=1, worker_init_fn=seen.append)
    loader.worker_init_fn(0)  # type: ignore[misc]
    assert seen == [0]


def test_loader_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="num_workers=-1"):
        get_dataloader([1, 2], num_workers=-1)
    # without a DATA group no sampler is added, so the user's own is fine
    sampler = torch.utils.data.SequentialSampler(range(2))
    assert get_dataloader([1, 2], sampler=sampler).sampler is sampler


def test_sampler_without_launch_is_one_replica() -> None:
    sampler = DataParallelSampler(range(6), shuffle=True, seed=5)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == list(range(6))
    assert first != second and sampler.epoch == 2  # upstream moves on after each pass
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_parallel_state_without_launch() -> None:
    assert not (is_using_ddp() or is_using_pp() or is_using_sequence())
    assert is_dp_rank_0() and is_tp_rank_0() and is_no_pp_or_last_stage()


# ---------------------------------------------------------------- signatures and import paths


def test_signatures_match_upstream() -> None:
    assert str(inspect.signature(get_dataloader)) == (
        "(dataset: 'Dataset[Any]', shuffle: 'bool' = False, seed: 'int' = 1024, "
        "add_sampler: 'bool' = True, drop_last: 'bool' = False, pin_memory: 'bool' = False, "
        "num_workers: 'int' = 0, **kwargs: 'Any') -> 'DataLoader[Any]'"
    )
    assert list(inspect.signature(MultiTimer).parameters) == ["on"]
    assert list(inspect.signature(MultiTimer.stop).parameters) == [
        "self",
        "name",
        "keep_in_history",
    ]


def test_old_import_paths_resolve() -> None:
    assert utils.get_dataloader is get_dataloader and utils.is_using_pp is is_using_pp
    assert utils.is_using_ddp is is_using_ddp and utils.is_using_sequence is is_using_sequence
    assert utils.MultiTimer is MultiTimer and utils.Timer is Timer
    assert utils.DataParallelSampler is DataParallelSampler
    from kolossos.nn.metric import Accuracy as OldAccuracy

    assert OldAccuracy is Accuracy and col_nn.metric.Accuracy is Accuracy
    from kolossos.legacy.nn import CrossEntropyLoss, loss

    assert loss.CrossEntropyLoss is CrossEntropyLoss is col_nn.CrossEntropyLoss


def test_lower_layers_do_not_load_the_legacy_api() -> None:
    code = (
        "import sys, kolossos.utils, kolossos.utils.timer, kolossos.nn, kolossos.nn.metric;"
        "assert not [m for m in sys.modules if m.startswith('kolossos.legacy')], 'legacy loaded'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
