"""``parallel=dict(tensor=dict(size=2, mode="sequence"))`` through ``kolossos.initialize`` trains
the small BERT of ``examples/legacy/sequence_parallel`` exactly as one process does: 2 ranks
(torch DDP over SEQUENCE_DP, and ``SequenceParallelGradientHandler`` with ``clip_grad_norm``)
and sequence 2 × data 2 on 4 ranks. Losses every step, parameters at the end (fp32, CPU/gloo).

The reference is the same model on a one-rank group (its ring has no hop) trained on the global
batch and whole sentences, built on every rank from the same seed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kolossos
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.testing import spawn
from kolossos.testing.parity import (
    assert_moved,
    assert_params_close,
    assert_same_on_all_ranks,
    global_mean,
    snapshot,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "legacy" / "sequence_parallel"
STEPS, GLOBAL_BATCH, SEQ, VOCAB, MASKED = 6, 4, 16, 32, 4
LR, CLIP, TOL = 0.2, 0.5, 1e-5
SEQUENCE = dict(parallel=dict(tensor=dict(size=2, mode="sequence")))
HANDLER = [dict(type="SequenceParallelGradientHandler")]
# name -> (config, world size)
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "ddp": (SEQUENCE, 2),
    "handler_clip": (dict(SEQUENCE, gradient_handler=HANDLER, clip_grad_norm=CLIP), 2),
    "seq2_dp2": (SEQUENCE, 4),
}


def _example(name: str) -> ModuleType:
    """``examples/legacy/sequence_parallel/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(
        f"sequence_parallel_{name}", EXAMPLE / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bert(group: dist.ProcessGroup | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model: torch.nn.Module = _example("model").BertForPretrain(
        vocab_size=VOCAB, hidden_size=32, max_sequence_length=SEQ, num_attention_heads=4,
        num_layers=2, dropout=0.0, group=group,
    )  # fmt: skip
    return model


def _train(rank: int, world_size: int, port: int, case: str) -> None:
    config, _ = CASES[case]
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    data, loss = _example("data"), _example("loss")
    alone, _ = dist.new_subgroups(group_size=1)  # this rank on its own: the reference's ring
    model, reference = _bert(None), _bert(alone)
    assert_params_close(model, reference, rtol=0, atol=0)
    initial = snapshot(model)
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, *_ = kolossos.initialize(model, sgd, loss.BertLoss(), verbose=False)
    assert engine.criterion is not None
    assert isinstance(engine.model, DDP) == ("gradient_handler" not in config)
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    ref_loss = loss.BertLoss(alone)
    ranks = [gpc.get_local_rank(m) for m in (ParallelMode.DATA, ParallelMode.SEQUENCE)]
    sizes = [gpc.get_world_size(m) for m in (ParallelMode.DATA, ParallelMode.SEQUENCE)]
    assert sizes == [world_size // 2, 2]
    losses, ref_losses, ref_norms = [], [], []
    engine.train()
    for step in range(STEPS):
        batch = data.synthetic_batch(step, GLOBAL_BATCH, SEQ, VOCAB, MASKED, seed=7)
        tokens, labels, padding = data.get_batch_for_sequence_parallel(
            batch, ranks[0], sizes[0], ranks[1], sizes[1]
        )
        engine.zero_grad()
        value = engine.criterion(engine(tokens, padding), labels)
        engine.backward(value)
        engine.step()
        losses.append(global_mean(value))  # P x each chunk's share, averaged: the loss

        ref_sgd.zero_grad()
        expected = ref_loss(reference(batch["tokens"], batch["padding_mask"]), batch["labels"])
        expected.backward()
        if "clip_grad_norm" in config:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        ref_sgd.step()
        ref_losses.append(float(expected))
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    assert_params_close(model, reference, rtol=TOL, atol=TOL)
    assert_moved(initial, model, TOL)
    assert_same_on_all_ranks(model)
    assert all(norm > CLIP for norm in ref_norms)  # clipping was active
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_matches_single_process(case: str) -> None:
    spawn(_train, CASES[case][1], case=case)
