"""The model zoo under 1D tensor parallelism trains like the dense zoo model (CPU/gloo, 2 ranks).

Each case builds the dense model from one seed before the launch (no tensor parallelism then),
launches with ``parallel=dict(tensor=dict(size=2, mode='1d'))``, builds the same zoo model again
(now from the 1D layers: column/row-parallel attention and MLP, split embeddings, a tied LM head)
from the same seed, and checks that it is the same model: the gathered 1D shards equal the dense
weights bit for bit (initialisation draws full tensors and keeps slices, ``init_method='jax'``
included). Both
train ``STEPS`` SGD steps with momentum on the same global batches (the TP ranks all see the whole
batch); the loss of every step, the gathered full parameters at the end (against the dense
model's) and that every parameter moved far beyond the tolerance are checked.

Cases: the ViT (``_create_vit_model``, ``init_method='jax'``, a representation layer) and the GPT
(word embedding tied to the head, a padding mask), each once with ``checkpoint=True`` on the
tensor-parallel side only (recomputation must not change the numbers). Dropout is 0 there (the
tensor-parallel masks differ by design); a second test trains the 1D model with every dropout
active, with and without ``checkpoint=True``, and asks for bitwise-equal losses and parameters
(the recomputation redraws the same masks, the per-rank tensor-parallel ones included).

Tolerance 1e-5 (fp32, CPU): only the order of partial sums differs (row-parallel all-reduce).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
from kolossos.legacy.models.gpt import GPT, GPTLMLoss
from kolossos.legacy.models.vit import _create_vit_model
from kolossos.legacy.models.vit_nd import full_state_dict, load_full_state_dict
from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
from kolossos.testing import spawn
from kolossos.testing.parity import assert_moved, snapshot

pytestmark = pytest.mark.dist

STEPS = 4
TOL = 1e-5
LR = 0.1
VOCAB, SEQ, BATCH = 64, 8, 4


def _build(kind: str, checkpoint: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "vit":
        return _create_vit_model(
            img_size=8, patch_size=4, dim=16, depth=2, num_heads=4, mlp_ratio=2, num_classes=5,
            dropout=0.0, representation_size=8, init_method="jax", checkpoint=checkpoint,
        )  # fmt: skip
    return GPT(
        vocab_size=VOCAB, max_position_embeddings=SEQ, dim=16, num_heads=4, depth=2, mlp_ratio=2,
        dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0, checkpoint=checkpoint,
    )  # fmt: skip


def _batches(kind: str) -> list[tuple[Any, ...]]:
    gen = torch.Generator().manual_seed(1)
    out: list[tuple[Any, ...]] = []
    for _ in range(STEPS):
        if kind == "vit":
            out.append((torch.randn(BATCH, 3, 8, 8, generator=gen),
                        torch.randint(0, 5, (BATCH,), generator=gen)))  # fmt: skip
        else:
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            mask = torch.ones(BATCH, SEQ)
            mask[0, -3:] = 0  # a padded sample
            out.append((ids, mask))
    return out


def _loss(kind: str, model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    if kind == "vit":
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)
    ids, mask = batch
    return GPTLMLoss()(model(ids, mask), ids)


def _train(kind: str, model: nn.Module, batches: list[tuple[Any, ...]]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    model.train()
    for batch in batches:
        opt.zero_grad()
        loss = _loss(kind, model, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _run(rank: int, world_size: int, port: int, kind: str, checkpoint: bool) -> None:
    dense = _build(kind, checkpoint=False)  # before the launch: plain torch layers
    kolossos.launch(
        dict(parallel=dict(tensor=dict(size=2, mode="1d"))), rank, world_size, "localhost", port,
        verbose=False,
    )  # fmt: skip
    model = _build(kind, checkpoint)
    layers = [m for m in model.modules() if isinstance(m, (Linear1D_Col, Linear1D_Row))]
    assert len(layers) >= 8, "the zoo model must be built from 1D layers under mode='1d'"
    # the same seed builds the same model: each rank holds its slices of the dense weights
    for name, value in full_state_dict(model).items():
        assert torch.equal(value, dense.state_dict()[name]), name
    load_full_state_dict(model, dense.state_dict())  # a no-op, also when it would not be
    initial = snapshot(dense)
    batches = _batches(kind)
    losses = _train(kind, model, batches)
    ref = _train(kind, dense, batches)
    torch.testing.assert_close(losses, ref, rtol=TOL, atol=TOL)
    final = full_state_dict(model)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(final[name], p.detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    assert_moved(initial, {n: final[n] for n in initial}, TOL)


@pytest.mark.parametrize(
    ("kind", "checkpoint"), [("vit", False), ("vit", True), ("gpt", False), ("gpt", True)]
)
def test_zoo_1d_matches_dense(kind: str, checkpoint: bool) -> None:
    spawn(_run, 2, kind=kind, checkpoint=checkpoint)


def _build_dropout(kind: str, checkpoint: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "vit":
        return _create_vit_model(
            img_size=8, patch_size=4, dim=16, depth=2, num_heads=4, mlp_ratio=2, num_classes=5,
            dropout=0.2, attention_dropout=0.2, drop_path=0.2, checkpoint=checkpoint,
        )  # fmt: skip
    return GPT(
        vocab_size=VOCAB, max_position_embeddings=SEQ, dim=16, num_heads=4, depth=2, mlp_ratio=2,
        dropout=0.2, embedding_dropout=0.2, attention_dropout=0.2, checkpoint=checkpoint,
    )  # fmt: skip


def _run_dropout(rank: int, world_size: int, port: int, kind: str) -> None:
    kolossos.launch(
        dict(parallel=dict(tensor=dict(size=2, mode="1d"))), rank, world_size, "localhost", port,
        verbose=False,
    )  # fmt: skip
    runs = []
    for checkpoint in (False, True):
        model = _build_dropout(kind, checkpoint)
        torch.manual_seed(7)  # the dropout masks (the TP streams derive from this generator)
        losses = _train(kind, model, _batches(kind))
        runs.append((losses, full_state_dict(model)))
    (off, off_params), (on, on_params) = runs
    assert off == on  # recomputation redraws the very same masks: bitwise equal
    for name, value in off_params.items():
        assert torch.equal(value, on_params[name]), name


@pytest.mark.parametrize("kind", ["vit", "gpt"])
def test_zoo_1d_checkpoint_with_dropout_is_exact(kind: str) -> None:
    """Under 1D TP with every dropout active (per-rank masks after column layers), training
    with ``checkpoint=True`` equals training without it, bit for bit."""
    spawn(_run_dropout, 2, kind=kind)
