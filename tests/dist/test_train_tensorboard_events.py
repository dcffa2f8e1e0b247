"""``kolossos train`` with ``metrics.tensorboard=true`` on 2 ranks: the event files TensorBoard
reads back hold every training and validation loss of ``metrics.jsonl`` at its step."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("tensorboard")  # the only reason to skip

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths
from kolossos.train.worker import run_worker

pytestmark = pytest.mark.dist

TINY = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
    "train.steps=4", "train.batch_size=8", "train.warmup_steps=1", "train.eval_interval=2",
    "train.eval_batches=1", "train.log_interval=1", "checkpoint.every=4", "sample.tokens=4",
    "metrics.tensorboard=true", "name=tb",
]  # fmt: skip


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files in ``folder``."""
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


@distributed(2)
def test_event_files_hold_the_metrics(tmp_path: Path) -> None:
    config = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0
    dist.barrier()
    if dist.get_rank() != 0:
        return
    paths = RunPaths.of(str(tmp_path), "tb")
    records = read_metrics(paths.metrics)
    found = scalars(paths.root / "tensorboard")
    for kind, key in (("train", "loss"), ("val", "val_loss"), ("train", "lr")):
        want = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        got = found[f"{kind}/{key}"]
        assert [s for s, _ in got] == [s for s, _ in want], (kind, key)
        # TensorBoard keeps float32 values: equal to the file's numbers rounded to float32
        assert [np.float32(v) for _, v in got] == [np.float32(v) for _, v in want], (kind, key)
    assert [s for s, _ in found["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in found["val/val_loss"]] == [0, 2, 4]
    assert {"train/tokens_per_s", "train/mem_bytes/rank0", "train/mem_bytes/rank1"} <= set(found)
