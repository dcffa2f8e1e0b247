"""Bytes communicated by one training step of the 2D MLP, against the closed form of SUMMA.

Closed form (per rank, in elements; CommCounter's logical bytes = elements x 4 in fp32). For a
``Linear2D`` with input block ``a = (B/q)(K/q)`` and weight block ``w = (K/q)(N/q)``:

* forward ``Y = X W`` (:func:`summa_ab`): ``q`` steps, each broadcasting an ``X`` block along
  the row and a ``W`` block along the column: ``q (a + w)``;
* backward ``dX = dY Wᵀ`` (:func:`summa_abt`): ``q`` broadcasts of ``W`` blocks and ``q``
  reductions of ``dX`` partials: ``q (w + a)`` — skipped when the input needs no gradient;
* backward ``dW = Xᵀ dY`` (:func:`summa_atb`): ``q`` broadcasts of ``X`` blocks and ``q``
  reductions of ``dW`` partials: ``q (a + w)``;
* the bias block ``[N/q²]``: an all-gather to ``N/q`` forward, a reduce-scatter of ``N/q``
  backward: ``2 N/q``.

So a layer moves ``3 q (a + w) + 2 N/q`` (``2 q (a + w) + 2 N/q`` for the first layer, whose
input needs no gradient): six SUMMA phases of ``q`` steps per layer, the ``O(6(q-1)/q)``
bandwidth term of the docs' cost table (F0:6377-6383) once the ring cost ``(q-1)/q`` of each
size-``q`` collective is applied.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kolossos
from kolossos.legacy.nn.layer.parallel_2d import Dropout2D, Linear2D, get_groups_2d
from kolossos.nn.layer.parallel_2d import split_batch_2d
from kolossos.testing import spawn
from kolossos.utils.profiling import CommCounter

pytestmark = pytest.mark.dist

BATCH, DIM, HIDDEN = 8, 16, 64
CONFIG = dict(parallel=dict(tensor=dict(size=4, mode="2d")))


def closed_form_bytes(
    q: int, batch: int, dim: int, hidden: int, itemsize: int = 4
) -> dict[str, int]:
    """Bytes per kind of one forward + backward of ``Linear2D(dim, hidden) -> GELU ->
    Linear2D(hidden, dim)`` on a ``q x q`` grid (input without gradient)."""
    a1, w1 = (batch // q) * (dim // q), (dim // q) * (hidden // q)
    a2, w2 = (batch // q) * (hidden // q), (hidden // q) * (dim // q)
    broadcast = q * (a1 + w1) + q * (a2 + w2) + q * w2 + q * a2 + q * a1
    reduce = q * a2 + q * w2 + q * w1
    bias = hidden // q + dim // q
    elements = {
        "broadcast": broadcast,
        "reduce": reduce,
        "all_gather": bias,
        "reduce_scatter": bias,
    }
    return {kind: n * itemsize for kind, n in elements.items()}


def _step(rank: int, world_size: int, port: int) -> dict[str, int]:
    kolossos.launch(
        config=CONFIG, rank=rank, world_size=world_size, host="localhost", port=port, verbose=False
    )
    mlp = nn.Sequential(Linear2D(DIM, HIDDEN), nn.GELU(), Linear2D(HIDDEN, DIM), Dropout2D(0.1))
    groups = get_groups_2d()
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(0))
    x = split_batch_2d(x, groups).chunk(groups.q, -1)[groups.col_index]
    with CommCounter() as comm:
        mlp(x).square().sum().backward()
    return {
        kind: comm.bytes(kind) for kind in ("broadcast", "reduce", "all_gather", "reduce_scatter")
    } | {"total": comm.bytes()}


def test_tp_2d_mlp_bytes_match_summa_closed_form() -> None:
    """Each rank's logical bytes per kind equal the closed form (asserted within 10%, exact in
    practice), and nothing else is communicated."""
    expected = closed_form_bytes(2, BATCH, DIM, HIDDEN)
    assert sum(expected.values()) == 14144  # the numbers, for the docs' table
    for measured in spawn(_step, 4):
        for kind, value in expected.items():
            assert measured[kind] == pytest.approx(value, rel=0.10), kind
        assert measured["total"] == pytest.approx(sum(expected.values()), rel=0.10)
        assert measured["total"] == sum(expected.values())
