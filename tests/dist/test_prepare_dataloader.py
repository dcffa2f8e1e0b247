"""prepare_dataloader: disjoint, complete, deterministic sharding; set_epoch reshuffles."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.testing import distributed


def _epoch_indices(loader: torch.utils.data.DataLoader, epoch: int) -> list[int]:  # type: ignore[type-arg]
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [int(i) for (batch,) in loader for i in batch]


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_every_sample_once_per_epoch(world_size: int) -> None:
    n = 48
    dataset = TensorDataset(torch.arange(n))
    plugin = TorchDDPPlugin()
    loader = plugin.prepare_dataloader(dataset, batch_size=4, shuffle=True, seed=7)
    epochs = []
    for epoch in range(2):
        mine = _epoch_indices(loader, epoch)
        gathered: list[list[int]] = [[] for _ in range(world_size)]
        dist.all_gather_object(gathered, mine)
        flat = [i for part in gathered for i in part]
        assert sorted(flat) == list(range(n)), "each sample exactly once per epoch"
        assert len(mine) == n // world_size
        epochs.append(flat)
    assert epochs[0] != epochs[1], "set_epoch must reshuffle"
    again = plugin.prepare_dataloader(dataset, batch_size=4, shuffle=True, seed=7)
    assert _epoch_indices(again, 0) == _epoch_indices(loader, 0), "deterministic for a seed"


@distributed(2)
def test_uneven_dataset_pads_or_drops() -> None:
    dataset = TensorDataset(torch.arange(7))
    plugin = TorchDDPPlugin()
    padded = plugin.prepare_dataloader(dataset, batch_size=2)
    dropped = plugin.prepare_dataloader(dataset, batch_size=1, drop_last=True)
    assert len(_epoch_indices(padded, 0)) == 4  # 7 padded to 8: every rank runs the same steps
    assert len(_epoch_indices(dropped, 0)) == 3
    with pytest.raises(ValueError, match="batch_size=0"):
        plugin.prepare_dataloader(dataset, batch_size=0)


@distributed(2)
def test_workers_are_seeded_deterministically() -> None:
    class RandomItems(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            import random

            return torch.tensor([i, random.randint(0, 10**6)])

    plugin = TorchDDPPlugin()
    runs = [
        torch.cat(list(plugin.prepare_dataloader(RandomItems(), batch_size=2, num_workers=2)))
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])
