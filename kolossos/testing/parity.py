"""Helpers for parity tests: a parallel run must train the same model as one process.

Recipe (ARCHITECTURE.md §4): every rank builds the same seeded model and a deep copy as the
reference; the reference trains on the whole global batch in-process, the boosted copy on this
rank's shard; losses are compared at every step (the mean of the shard losses over ranks equals the
full-batch loss for a mean-reduced criterion and equal shards) and parameters at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeAlias

import torch
import torch.distributed as dist
import torch.nn as nn


class TinyMLP(nn.Module):
    """A two-layer classifier small enough for many multi-process tests per second."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def make_classification_batches(
    steps: int, batch: int, d_in: int = 16, classes: int = 8, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``(inputs, labels)``, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, d_in, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen),
        )
        for _ in range(steps)
    ]


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (the batch must divide evenly)."""
    if tensor.shape[0] % world_size:
        raise ValueError(f"batch of {tensor.shape[0]} does not split over {world_size} ranks.")
    size = tensor.shape[0] // world_size
    return tensor[rank * size : (rank + 1) * size]


def global_mean(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """The mean of a scalar over the ranks of ``group``."""
    t = value.detach().float().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return float(t.item())


def assert_params_close(
    actual: nn.Module | Iterable[tuple[str, torch.Tensor]],
    expected: nn.Module | Iterable[tuple[str, torch.Tensor]],
    rtol: float,
    atol: float,
) -> None:
    """Every named parameter of ``actual`` equals ``expected``'s within the tolerances (compared in
    fp32; names must match)."""
    a = dict(actual.named_parameters() if isinstance(actual, nn.Module) else actual)
    e = dict(expected.named_parameters() if isinstance(expected, nn.Module) else expected)
    assert a.keys() == e.keys(), f"parameter names differ: {sorted(a.keys() ^ e.keys())}"
    for name, value in a.items():
        torch.testing.assert_close(
            value.detach().float(),
            e[name].detach().float(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"parameter {n}: {m}",  # type: ignore[misc]
        )


def assert_same_on_all_ranks(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every parameter is bitwise identical on every rank of ``group``."""
    for name, p in module.named_parameters():
        local = p.detach().float().contiguous()
        ref = local.clone()
        dist.broadcast(ref, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        assert torch.equal(local, ref), f"parameter {name} differs from rank 0's"


Named: TypeAlias = "nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]"


def _named(params: Named) -> dict[str, torch.Tensor]:
    return dict(params.named_parameters() if isinstance(params, nn.Module) else params)


def snapshot(params: Named) -> dict[str, torch.Tensor]:
    """Detached fp32 copies of named tensors (a module's parameters, a mapping or ``(name,
    tensor)`` pairs): the "before" of :func:`assert_moved`, taken before training."""
    return {name: t.detach().float().clone() for name, t in _named(params).items()}


def assert_moved(
    before: Named,
    after: Named,
    atol: float,
    factor: float = 10.0,
    *,
    each: float | None = None,
    exclude: Iterable[str] = (),
) -> dict[str, float]:
    """Training moved the named tensors of ``after`` away from their values in ``before`` by at
    least ``factor * atol``: each tensor's largest element move reaches ``each * atol``
    (``each`` defaults to ``factor``), and the largest move of all reaches ``factor * atol``.
    Returns each name's largest move.

    A parity check ``assert_close(trained, reference, atol=atol)`` cannot fail where training
    moved a parameter by less than ``atol``: a run in which no step happened would pass. Call
    this on the trained parameters (gathered to full size where they are sharded) and their
    initial values, with the parity check's ``atol``. ``before`` and ``after`` are modules (their
    ``named_parameters()``), mappings or ``(name, tensor)`` pairs; every name of ``after`` needs
    a value in ``before``. ``exclude`` names tensors that are not meant to move (frozen, unused).
    A smaller ``each`` is for low-precision runs whose rounding differences, and so their
    tolerance, come within ``factor`` of the slowest parameter's move (``each=0`` checks only
    the largest move). Compared in fp32; a NaN move fails.

    Example:
        >>> import torch
        >>> before = {"w": torch.zeros(3), "b": torch.zeros(2)}
        >>> after = {"w": torch.tensor([0.0, 2e-3, -1e-4]), "b": torch.ones(2)}
        >>> moves = assert_moved(before, after, atol=1e-4)  # each must move by >= 10 x 1e-4
        >>> {name: round(move, 6) for name, move in moves.items()}
        {'w': 0.002, 'b': 1.0}
        >>> after["w"] = torch.tensor([5e-4, 0.0, 0.0])
        >>> assert_moved(before, after, atol=1e-4)
        Traceback (most recent call last):
        ...
        AssertionError: moved by less than 10 x the parity tolerance 0.0001 = 0.001: w (largest \
move 0.0005)
        >>> _ = assert_moved(before, after, atol=1e-4, each=2.0)  # w: >= 2e-4; b: >= 1e-3
    """
    old, new = _named(before), _named(after)
    skip = set(exclude)
    missing = sorted(set(new) - set(old) - skip)
    assert not missing, f"no initial value for {missing}"
    moves: dict[str, float] = {}
    for name, value in new.items():
        if name not in skip:
            delta = value.detach().float() - old[name].detach().float().to(value.device)
            moves[name] = float(delta.abs().max()) if delta.numel() else 0.0
    assert moves, "no tensors to check"
    each = factor if each is None else each
    short = [f"{n} (largest move {m:.3g})" for n, m in moves.items() if not m >= each * atol]
    assert not short, (
        f"moved by less than {each:g} x the parity tolerance {atol:g} = {each * atol:g}: "
        + "; ".join(short)
    )
    top = max(moves, key=lambda n: moves[n])
    assert moves[top] >= factor * atol, (
        f"the largest move, {moves[top]:.3g} ({top}), is less than {factor:g} x the parity "
        f"tolerance {atol:g} = {factor * atol:g}"
    )
    return moves


def assert_run_matches(
    losses: Iterable[float],
    ref_losses: Iterable[torch.Tensor | float],
    params: Named,
    reference: nn.Module,
    before: Named,
    *,
    loss_atol: float,
    param_atol: float,
    label: str = "",
    exclude: Iterable[str] = (),
) -> None:
    """A parallel run trained the same model as its single-process ``reference``: every step's
    loss (already averaged over data-parallel ranks) within ``loss_atol``, every parameter of
    ``reference`` equal by name in ``params`` (gathered to full size) within ``param_atol``, and
    training moved them far more than ``param_atol`` (:func:`assert_moved` against ``before``;
    ``exclude`` names parameters whose true gradient is zero, which are only compared)."""
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(float(got) - float(want)) <= loss_atol, (label, step, float(got), float(want))
    trained = _named(params)
    for name, want in reference.named_parameters():
        prefix = f"{label} {name}: "
        torch.testing.assert_close(
            trained[name], want.detach(), atol=param_atol, rtol=0, msg=prefix.__add__
        )
    assert_moved(before, trained, atol=param_atol, exclude=exclude)


def train_causal_lm(
    model: nn.Module,
    ids: torch.Tensor,
    lr: float,
    local: Callable[[torch.Tensor], torch.Tensor] | None = None,
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """Train a Hugging Face causal LM with Adam on ``ids[step]`` (``(steps, batch, seq)``, the
    labels are the inputs) and return each step's loss; ``local`` picks this rank's part of a
    step's global batch (identity for the single-process reference). ``eps`` is Adam's: a
    larger one keeps Adam from normalising gradient elements far below it (a parameter whose
    true gradient is zero then moves by its rounding noise times ``lr / eps``, not by ``lr``)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
    losses = []
    for step in range(ids.shape[0]):
        batch = ids[step] if local is None else local(ids[step])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def reference_causal_lm(
    base: nn.Module,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    vocab: int = 128,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, nn.Module, dict[str, torch.Tensor], list[torch.Tensor]]:
    """The single-process side of a causal-LM parity test: random token ids ``(steps, batch,
    seq)`` below ``vocab`` (from the current seed), a deep copy of ``base`` trained on them by
    :func:`train_causal_lm` (Adam's ``eps``), its parameters before training and its loss at
    every step.

    Returns:
        ``(ids, reference, before, losses)``.
    """
    import copy

    ids = torch.randint(0, vocab, (steps, batch, seq))
    reference = copy.deepcopy(base)
    before = snapshot(reference)
    return ids, reference, before, train_causal_lm(reference, ids, lr, eps=eps)
