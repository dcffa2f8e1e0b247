"""Helpers for parity tests: a parallel run must train the same model as one process.

Recipe (ARCHITECTURE.md §4): every rank builds the same seeded model and a deep copy as the
reference; the reference trains on the whole global batch in-process, the boosted copy on this
rank's shard; losses are compared at every step (the mean of the shard losses over ranks equals the
full-batch loss for a mean-reduced criterion and equal shards) and parameters at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

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
