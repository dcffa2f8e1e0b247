"""Asynchronous checkpoints: ``booster.save_model/save_optimizer(use_async=True)`` and
``kolossos train``'s ``checkpoint.async``.

The files an asynchronous save writes are byte-identical to a synchronous save's, they hold the
state at the moment of the call (training may go on while they are written), a failed background
write surfaces as a named error, and a run with ``checkpoint.async=true`` stops and resumes with
exactly the losses, weights and checkpoints of a synchronous run.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel

from kolossos.booster import Booster
from kolossos.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from kolossos.checkpoint_io import CheckpointError
from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths, complete_checkpoints
from kolossos.train.worker import EXIT_INTERRUPTED, run_worker

from test_train_resume import StopAfter, losses, run_configs

PLUGINS = {
    "torch_ddp": lambda: TorchDDPPlugin(),
    "low_level_zero": lambda: LowLevelZeroPlugin(stage=2),
    "gemini": lambda: GeminiPlugin(),
}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _step(booster: Booster, model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    ids = ids.chunk(dist.get_world_size())[dist.get_rank()]
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)  # type: ignore[arg-type]
    opt.step()
    opt.zero_grad()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
@distributed(2)
def test_async_save_writes_the_state_of_the_call_byte_identical(
    tmp_path: Path, plugin: str
) -> None:
    booster = Booster(plugin=PLUGINS[plugin]())
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)  # type: ignore[assignment]
    _step(booster, model, opt, 0)
    root = tmp_path / "ckpt"
    booster.save_model(model, str(root / "sync_model"), shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, str(root / "sync_optim"), shard=True, size_per_shard=0.01)
    booster.save_model(
        model, str(root / "async_model"), shard=True, size_per_shard=0.01, use_async=True
    )
    booster.save_optimizer(
        opt, str(root / "async_optim"), shard=True, size_per_shard=0.01, use_async=True
    )
    _step(booster, model, opt, 1)  # training goes on while the files are written
    booster.wait_async_saves()
    assert not booster.async_saves_pending()
    dist.barrier()
    for kind in ("model", "optim"):
        sync, later = _files(root / f"sync_{kind}"), _files(root / f"async_{kind}")
        assert sync.keys() == later.keys() and len(sync) >= 2  # files and an index
        assert sync == later, kind
    # a load through the Booster waits for pending writes on its own
    booster.save_model(model, str(root / "late"), shard=True, use_async=True)
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_booster = Booster(plugin=PLUGINS[plugin]())
    fresh, fresh_opt, *_ = fresh_booster.boost(fresh, fresh_opt)  # type: ignore[assignment]
    booster.load_model(fresh, str(root / "late"))
    mine = dict(booster.checkpoint_io.model_state_items(model, True))
    theirs = dict(fresh_booster.checkpoint_io.model_state_items(fresh, True))
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        torch.testing.assert_close(theirs[name], tensor, rtol=0, atol=0)


@distributed(2)
def test_a_failed_background_write_is_named_and_keeps_nothing_half_written(
    tmp_path: Path,
) -> None:
    booster = Booster(plugin=TorchDDPPlugin())
    model, *_ = booster.boost(_model())
    blocker = tmp_path / "not_a_folder"
    if dist.get_rank() == 0:
        blocker.write_text("a file where the checkpoint's parent folder should be")
    dist.barrier()
    booster.save_model(model, str(blocker / "model"), shard=True, use_async=True)
    if dist.get_rank() == 0:  # the writer rank's background write fails
        with pytest.raises(CheckpointError, match="not_a_folder/model.*in the background"):
            booster.wait_async_saves()
        assert blocker.read_text().startswith("a file")
    else:
        booster.wait_async_saves()  # nothing to write on this rank


@pytest.mark.parametrize("plugin", ["gemini", "hybrid_parallel", "low_level_zero", "torch_ddp"])
@distributed(2)
def test_an_async_run_stops_and_resumes_like_a_synchronous_one(
    tmp_path: Path, plugin: str
) -> None:
    configs = run_configs(tmp_path, plugin, {"sync": [], "async": ["checkpoint.async=true"]})
    quiet = io.StringIO()
    assert run_worker(configs["sync"], stream=quiet, install_signals=False) == 0
    code = run_worker(configs["async"], stream=quiet, install_signals=False, stop=StopAfter(5))
    assert code == EXIT_INTERRUPTED
    paths = {name: RunPaths.of(str(tmp_path), name) for name in configs}
    assert [s for s, _ in complete_checkpoints(paths["async"].checkpoints)] == [2, 4]
    dist.barrier()
    assert run_worker(configs["async"], resume=True, stream=quiet, install_signals=False) == 0
    dist.barrier()
    assert losses(paths["async"]) == losses(paths["sync"])  # exact in fp32
    assert [r["step"] for r in read_metrics(paths["async"].metrics) if r["kind"] == "train"] == (
        list(range(1, 10))
    )
    for name in configs:
        assert [s for s, _ in complete_checkpoints(paths[name].checkpoints)] == [8, 9]
        assert not [p for p in paths[name].checkpoints.iterdir() if p.name.startswith(".")]
    if dist.get_rank() == 0:
        assert "writing the checkpoint in the background" in quiet.getvalue()
        for part in ("model", "optimizer"):
            final = {n: paths[n].checkpoints / "step_000009" / part for n in configs}
            assert _files(final["sync"]) == _files(final["async"]), part
