"""Shared pieces of data-parallel plugins: the data-parallel group and ``prepare_dataloader``."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from kolossos.accelerator import get_accelerator
from kolossos.booster.plugin.plugin_base import Plugin


def _require_process_group(plugin: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{plugin} needs torch.distributed to be initialised; call "
            "kolossos.launch_from_torch() (or kolossos.launch) before creating the plugin."
        )


class _WorkerSeeder:
    """Seeds python's and numpy's RNGs in a loader worker from torch's per-worker seed, which the
    loader derives from its generator: reproducible for a given (seed, rank, epoch, worker)."""

    def __call__(self, worker_id: int) -> None:
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:
            return
        np.random.seed(seed)


class DPPluginBase(Plugin):
    """A plugin whose data parallelism spans ``dp_group`` (default: every process)."""

    def __init__(self, dp_group: dist.ProcessGroup | None = None) -> None:
        _require_process_group(type(self).__name__)
        self.dp_group = dp_group
        self.rank = dist.get_rank()
        self.dp_rank = dist.get_rank(dp_group)
        self.dp_size = dist.get_world_size(dp_group)

    # The answers every data-parallel plugin shares; a plugin overrides the ones that differ.
    def supported_devices(self) -> list[str]:
        return ["cpu", "cuda"]

    def control_device(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return True

    def control_checkpoint_io(self) -> bool:
        return True

    def prepare_dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A ``DataLoader`` over this rank's share of ``dataset`` (``batch_size`` per rank).

        The ``DistributedSampler`` gives the ranks disjoint parts of the same permutation (seeded
        by ``seed``; call ``loader.sampler.set_epoch(epoch)`` for a new shuffle each epoch). When
        ``len(dataset)`` is not a multiple of the data-parallel size, the sampler pads with
        repeated samples (``drop_last=False``) or drops the tail (``drop_last=True``), so every
        rank runs the same number of steps. Workers are seeded deterministically.

        Raises:
            ValueError: a batch size below 1 or a negative worker count.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (per rank).")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0.")
        sampler = kwargs.pop("sampler", None) or DistributedSampler(
            dataset,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        generator = torch.Generator()
        generator.manual_seed(seed + self.dp_rank)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            worker_init_fn=_WorkerSeeder(),
            drop_last=drop_last,
            pin_memory=pin_memory and get_accelerator().name != "cpu",
            num_workers=num_workers,
            generator=generator,
            **kwargs,
        )
