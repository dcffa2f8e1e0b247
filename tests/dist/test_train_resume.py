"""``kolossos train`` on 2 ranks, with every plugin in the registry: stopping after k steps and
resuming gives exactly the loss sequence, the final weights and the sample of the uninterrupted
run (fp32, dropout on, gradient accumulation on), and only the last K checkpoints are kept."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel  # noqa: F401  (imported once, before forking)

from kolossos.booster.plugin import PLUGINS
from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.loop import StopFlag
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths, complete_checkpoints
from kolossos.train.worker import EXIT_INTERRUPTED, run_worker

STEPS, STOP_AT, EVERY, KEEP = 9, 5, 2, 2
TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "train.gradient_accumulation=2",
    "train.warmup_steps=2",
    "train.eval_interval=3",
    "train.eval_batches=1",
    "train.log_interval=2",
    f"checkpoint.every={EVERY}",
    f"checkpoint.keep_last={KEEP}",
    "sample.tokens=8",
    "model.dropout=0.1",
]


class StopAfter(StopFlag):
    """Asks for a stop at the end of step ``k`` (``requested`` is read once per step)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.reads = k, 0

    @property
    def requested(self) -> bool:
        self.reads += 1
        return self.reads >= self.k


def losses(paths: RunPaths) -> list[tuple[str, int, float]]:
    return [
        (r["kind"], r["step"], r["loss"] if r["kind"] == "train" else r["val_loss"])
        for r in read_metrics(paths.metrics)
    ]


# Plugins whose constructor needs an argument the default config does not give.
REQUIRED_KWARGS = {"hybrid_parallel": ["plugin_kwargs.tp_size=2"]}


def run_configs(tmp_path: Path, plugin: str, runs: dict[str, list[str]]) -> dict[str, Any]:
    """One tiny config per run name (with that run's extra overrides), all under ``tmp_path``."""
    common = [*TINY, f"output_dir={tmp_path}", f"plugin={plugin}", *REQUIRED_KWARGS.get(plugin, [])]
    return {name: load_config(None, [*common, f"name={name}", *extra]) for name, extra in runs.items()}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))  # every registered plugin
@distributed(2)
def test_stop_and_resume_equals_uninterrupted(tmp_path: Path, plugin: str) -> None:
    rank = dist.get_rank()
    configs = run_configs(tmp_path, plugin, {"straight": [], "resumed": []})
    quiet = io.StringIO()
    assert run_worker(configs["straight"], stream=quiet, install_signals=False) == 0
    code = run_worker(
        configs["resumed"], stream=quiet, install_signals=False, stop=StopAfter(STOP_AT)
    )
    assert code == EXIT_INTERRUPTED
    paths = {name: RunPaths.of(str(tmp_path), name) for name in configs}
    assert [s for s, _ in complete_checkpoints(paths["resumed"].checkpoints)] == [2, 4]
    dist.barrier()
    torch.manual_seed(1234 + rank)  # disturb the RNG: resume must restore it (dropout is on)
    assert run_worker(configs["resumed"], resume=True, stream=quiet, install_signals=False) == 0
    dist.barrier()

    straight, resumed = losses(paths["straight"]), losses(paths["resumed"])
    assert [s for k, s, _ in straight if k == "train"] == list(range(1, STEPS + 1))
    assert resumed == straight  # exact equality in fp32
    for name in configs:
        kept = [s for s, _ in complete_checkpoints(paths[name].checkpoints)]
        assert kept == [8, 9]  # saved after 2, 4, 6, 8 and the last step; the last K=2 kept
        assert not [p for p in paths[name].checkpoints.iterdir() if p.name.startswith(".")]
    if rank == 0:
        out = quiet.getvalue()
        assert "resumed from" in out and "finished 9 steps" in out, out
        for name in configs:
            summary = json.loads(paths[name].summary.read_text())
            assert summary["steps"] == STEPS and summary["final_val_loss"] is not None
            assert paths[name].plot.stat().st_size > 0
        assert paths["straight"].sample.read_text() == paths["resumed"].sample.read_text()
        final = {n: paths[n].checkpoints / "step_000009" / "model" for n in configs}
        for file in sorted(p.name for p in final["straight"].iterdir()):
            assert (final["straight"] / file).read_bytes() == (final["resumed"] / file).read_bytes()
