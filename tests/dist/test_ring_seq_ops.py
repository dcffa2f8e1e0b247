"""The ring sequence-parallel ops (``ring_ops``) and the overlapped region entry
(``seq_overlap``) vs the all-gather / reduce-scatter ops they replace, on 2 and 4 gloo ranks.

Exactness: a gather moves values, so it is compared bit for bit on random data. Sums (the
reduce-scatter, the matmuls on chunks instead of the whole sequence) are compared bit for bit on
small integer-valued data, where float32 arithmetic is exact whatever the order of the additions,
and to 1e-6 on random data (the ring adds the ranks' partial sums in ring order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.pytorch_utils import Conv1D

from kolossos.nn.layer.parallel_1d import (
    Linear1D_Col,
    Linear1D_Row,
    gather_seq_reduce_scatter_grad,
    reduce_scatter_seq_gather_grad,
)
from kolossos.nn.layer.parallel_1d._comm import all_gather_along, reduce_scatter_along
from kolossos.nn.layer.parallel_1d.ring_ops import (
    ring_all_gather_along,
    ring_gather_linears,
    ring_linear_reduce_scatter,
    ring_reduce_scatter_along,
)
from kolossos.nn.layer.parallel_1d.seq_overlap import overlapped_gather_linears
from kolossos.shardformer.layer import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from kolossos.testing import distributed
from kolossos.utils.profiling import CommCounter
from kolossos.utils.profiling.estimators import collective_sent_bytes

pytestmark = pytest.mark.dist

BATCH, SHARD, HIDDEN, OUT = 2, 3, 8, 6  # sequence per rank 3: a shard not a power of two
CLOSE = {"rtol": 1e-6, "atol": 1e-6}
EXACT = {"rtol": 0.0, "atol": 0.0}


def _data(*shape: int, seed: int, integer: bool) -> torch.Tensor:
    """The same tensor on every rank; small integers (exact float sums) or normal floats."""
    gen = torch.Generator().manual_seed(seed)
    if integer:
        return torch.randint(-2, 3, shape, generator=gen).float()
    return torch.randn(shape, generator=gen)


def _groups() -> list[tuple[dist.ProcessGroup, int]]:
    """The world, and at 4 ranks the subgroup {1, 3} (a ring over non-consecutive global ranks),
    with each group's size."""
    world = dist.get_world_size()
    out = [(dist.group.WORLD, world)]
    if world == 4:
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        out.append((pairs[dist.get_rank() % 2], 2))
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ring_collectives_equal_the_collectives(world_size: int) -> None:
    for group, size in _groups():
        rank = dist.get_rank(group)
        x = _data(BATCH, SHARD, HIDDEN, seed=rank, integer=False)
        torch.testing.assert_close(
            ring_all_gather_along(x, 1, group), all_gather_along(x, 1, group), **EXACT
        )
        for integer, tol in ((True, EXACT), (False, CLOSE)):
            full = _data(BATCH, SHARD * size, HIDDEN, seed=10 + rank, integer=integer)
            ring = ring_reduce_scatter_along(full, 1, group)
            torch.testing.assert_close(ring, reduce_scatter_along(full, 1, group), **tol)
            assert ring.shape == (BATCH, SHARD, HIDDEN)


def _grads(
    run: Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]],
    x: torch.Tensor,
    params: list[torch.Tensor],
    seed: int,
    integer: bool,
) -> list[torch.Tensor]:
    """Outputs, then the gradients of ``x`` and ``params`` for fixed output gradients."""
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() for p in params]
    outs = run(x, params)
    grads = [_data(*o.shape, seed=seed + i, integer=integer) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [t.grad for t in (x, *params)]  # type: ignore[misc]


def _gather_linears_cases(
    group: dist.ProcessGroup, fused: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]
) -> None:
    """``fused(x, [w1, w2], [b1, None])`` vs all-gather, then ``linear`` per weight; the gathered
    input itself is used too (its gradient joins the reduce-scatter)."""
    rank = dist.get_rank(group)

    def plain(x: torch.Tensor, p: list[torch.Tensor]) -> list[torch.Tensor]:
        full = gather_seq_reduce_scatter_grad(x, group, dim=1)
        return [full * 0.5, F.linear(full, p[0], p[1]), F.linear(full, p[2])]

    def mine(x: torch.Tensor, p: list[torch.Tensor]) -> list[torch.Tensor]:
        full, ys = fused(x, [p[0], p[2]], [p[1], None], group, 1)
        return [full * 0.5, *ys]

    for integer, tol in ((True, EXACT), (False, CLOSE)):
        x = _data(BATCH, SHARD, HIDDEN, seed=rank, integer=integer)
        params = [
            _data(OUT, HIDDEN, seed=20, integer=integer),
            _data(OUT, seed=21, integer=integer),
            _data(2 * OUT, HIDDEN, seed=22, integer=integer),
        ]
        expected = _grads(plain, x, params, seed=30, integer=integer)
        got = _grads(mine, x, params, seed=30, integer=integer)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ring_gather_linears_equal_gather_then_linear(world_size: int) -> None:
    for group, _ in _groups():
        _gather_linears_cases(group, ring_gather_linears)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_overlapped_gather_linears_equal_gather_then_linear(world_size: int) -> None:
    for group, _ in _groups():
        _gather_linears_cases(group, overlapped_gather_linears)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ring_linear_reduce_scatter_equals_linear_then_reduce_scatter(world_size: int) -> None:
    for group, size in _groups():
        rank = dist.get_rank(group)

        def plain(
            x: torch.Tensor, p: list[torch.Tensor], group: dist.ProcessGroup = group
        ) -> list[torch.Tensor]:
            return [reduce_scatter_seq_gather_grad(F.linear(x, p[0]), group, dim=1)]

        def mine(
            x: torch.Tensor, p: list[torch.Tensor], group: dist.ProcessGroup = group
        ) -> list[torch.Tensor]:
            return [ring_linear_reduce_scatter(x, p[0], group, dim=1)]

        for integer, tol in ((True, EXACT), (False, CLOSE)):
            x = _data(BATCH, SHARD * size, HIDDEN, seed=40 + rank, integer=integer)
            w = [_data(OUT, HIDDEN, seed=50 + rank, integer=integer)]
            expected = _grads(plain, x, w, seed=60 + rank, integer=integer)
            got = _grads(mine, x, w, seed=60 + rank, integer=integer)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ring_layers_equal_split_gather_layers(world_size: int) -> None:
    """``Linear1D_Col`` / ``Linear1D_Row`` with ``seq_parallel_mode='ring'`` vs 'split_gather'
    (an MLP: column, GELU, row), outputs and all gradients."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)
    x = _data(BATCH, SHARD, HIDDEN, seed=dist.get_rank(), integer=False)
    results = []
    for mode in ("split_gather", "ring"):
        col = Linear1D_Col.from_native_module(up, seq_parallel_mode=mode)
        row = Linear1D_Row.from_native_module(down, seq_parallel_mode=mode)
        inp = x.clone().requires_grad_()
        out = row(F.gelu(col(inp)))
        out.backward(_data(*out.shape, seed=7, integer=False))
        grads = [p.grad for p in (*col.parameters(), *row.parameters())]
        results.append([out.detach(), inp.grad, *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)
    with pytest.raises(NotImplementedError, match="overlap=True with seq_parallel_mode='ring'"):
        Linear1D_Col.from_native_module(up, seq_parallel_mode="ring", overlap=True)
    # GPT-2's fused Conv1D layers (weights stored (in, out)) take the mode through their options
    c_attn, c_proj = Conv1D(3 * HIDDEN, HIDDEN), Conv1D(HIDDEN, HIDDEN)
    results = []
    for mode in ("split_gather", "ring"):
        col = GPT2FusedLinearConv1D_Col.from_native_module(c_attn, seq_parallel_mode=mode)
        row = GPT2FusedLinearConv1D_Row.from_native_module(c_proj, seq_parallel_mode=mode)
        inp = x.clone().requires_grad_()
        out = row(col(inp)[..., : HIDDEN // world_size])  # this rank's q heads
        out.backward(_data(*out.shape, seed=8, integer=False))
        grads = [p.grad for p in (*col.parameters(), *row.parameters())]
        results.append([out.detach(), inp.grad, *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **CLOSE)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_ring_sends_the_bytes_of_the_collectives(world_size: int) -> None:
    """Each ring op sends (P - 1) / P of the full activation per rank, as the bandwidth-optimal
    all-gather / reduce-scatter does: counted on the point-to-point sends."""
    group, size = dist.group.WORLD, world_size
    x = _data(BATCH, SHARD, HIDDEN, seed=dist.get_rank(), integer=False).requires_grad_()
    w = _data(OUT, HIDDEN, seed=1, integer=False).requires_grad_()
    full_bytes = BATCH * SHARD * size * HIDDEN * 4
    gather_bytes = collective_sent_bytes("all_gather", full_bytes, size, "ring")
    with CommCounter() as comm:
        ring_all_gather_along(x.detach(), 1, group)
    assert comm.bytes("send") == gather_bytes == (size - 1) * BATCH * SHARD * HIDDEN * 4
    assert comm.calls("send") == size - 1
    assert comm.calls("all_gather") == comm.calls("reduce_scatter") == 0
    with CommCounter() as comm:
        _, (y,) = ring_gather_linears(x, [w], [None], group, 1)
        y.sum().backward()  # forward ring gather + backward ring reduce-scatter (input grads)
    assert comm.bytes("send") == 2 * gather_bytes
    out_full_bytes = BATCH * SHARD * size * OUT * 4
    rs_bytes = collective_sent_bytes("reduce_scatter", out_full_bytes, size, "ring")
    h = _data(BATCH, SHARD * size, HIDDEN, seed=2, integer=False).requires_grad_()
    with CommCounter() as comm:
        ring_linear_reduce_scatter(h, w, group, 1).sum().backward()
    assert comm.bytes("send") == 2 * rs_bytes  # reduce-scatter forward, all-gather backward
    assert comm.calls() == comm.calls("send") + comm.calls("recv")


class _OpLog(TorchDispatchMode):
    """Records the matmuls run while active into a shared event log."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
            self.log.append("mm")
        return func(*args, **(kwargs or {}))


class _LoggedWork:
    def __init__(self, work: Any, log: list[str]) -> None:
        self.work, self.log = work, log

    def wait(self) -> Any:
        self.log.append("wait")
        return self.work.wait()


def _logging(fn: Callable[..., Any], name: str, log: list[str]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log.append(name)
        out = fn(*args, **kwargs)
        if isinstance(out, list):
            return [_LoggedWork(w, log) for w in out]
        return _LoggedWork(out, log) if kwargs.get("async_op") else out

    return wrapper


def _between(log: list[str], start: str) -> list[list[str]]:
    """For every ``start`` event, the events up to the next ``wait``."""
    spans, i = [], 0
    while start in log[i:]:
        i = log.index(start, i) + 1
        j = log.index("wait", i)
        spans.append(log[i:j])
        i = j
    return spans


@distributed(2)
def test_communication_is_started_before_the_independent_matmuls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a timing: the order of events. Each async collective / ring exchange is started, then
    matmuls that do not need its result run, then it is waited for."""
    log: list[str] = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, _logging(getattr(dist, name), "all_gather", log))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, _logging(getattr(dist, name), "reduce_scatter", log))
    monkeypatch.setattr(dist, "batch_isend_irecv", _logging(dist.batch_isend_irecv, "p2p", log))
    group = dist.group.WORLD
    x = _data(BATCH, SHARD, HIDDEN, seed=dist.get_rank(), integer=False).requires_grad_()
    ws = [_data(OUT, HIDDEN, seed=s, integer=False).requires_grad_() for s in (1, 2)]
    h = _data(BATCH, 2 * SHARD, HIDDEN, seed=3, integer=False).requires_grad_()

    _, ys = overlapped_gather_linears(x, ws, [None, None], group, 1)
    log.clear()
    with _OpLog(log):
        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
    # backward: all-gather of the input || input-gradient matmuls; reduce-scatter || weight grads
    assert [e for e in log if e != "mm"][:2] == ["all_gather", "wait"]
    assert _between(log, "all_gather") == [["mm", "mm"]]
    assert _between(log, "reduce_scatter") == [["mm", "mm"]]

    for run in (
        lambda: ring_gather_linears(x, ws, [None, None], group, 1)[1],
        lambda: [ring_linear_reduce_scatter(h, ws[0], group, 1)],
    ):
        log.clear()
        with _OpLog(log):
            outs = run()
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        spans = _between(log, "p2p")
        # forward and backward: one exchange each at 2 ranks, matmuls running while it travels
        assert len(spans) == 2 and all("mm" in span for span in spans), log
