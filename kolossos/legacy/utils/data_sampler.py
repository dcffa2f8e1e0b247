"""``get_dataloader`` and its sampler, ``DataParallelSampler``: Colossal-AI's legacy data
loading, sharded over the global context's DATA group only.

The ranks of one tensor- or pipeline-parallel group share a DATA rank, so they read the same
batches; the DATA groups partition the dataset. Without a launch (or with one DATA rank) the
loader reads the whole dataset.

Example (``parallel=dict(tensor=dict(size=2, mode="1d"))`` on 4 ranks: DATA groups [0, 2] and
[1, 3], so ranks 0 and 1 read the same half)::

    loader = get_dataloader(train_dataset, shuffle=True, batch_size=gpc.config.BATCH_SIZE)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from kolossos.accelerator import get_accelerator
from kolossos.legacy.context.parallel_context import global_context as gpc
from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.registry import DATA_SAMPLERS

__all__ = ["DataParallelSampler", "get_dataloader"]


@DATA_SAMPLERS.register_module
class DataParallelSampler(DistributedSampler):
    """This DATA rank's share of ``dataset``: every ``dp_size``-th index of one permutation.

    The permutation is drawn from ``seed + epoch`` (the same on every rank). A shuffling sampler
    moves to the next epoch after each full pass, as Colossal-AI's does; ``set_epoch`` sets it.
    When ``len(dataset)`` is not a multiple of the DATA size, the share is padded with repeated
    indices (``drop_last=False``) or the tail is dropped, so every rank runs the same steps.

    Args:
        dataset: the dataset (with ``__len__``).
        shuffle: draw a new permutation each epoch.
        seed: the permutation seed.
        drop_last: drop the tail instead of padding.

    Example:
        >>> sampler = DataParallelSampler(range(10))  # no launch: one DATA rank
        >>> list(sampler)[:3]
        [0, 1, 2]
    """

    def __init__(
        self, dataset: Dataset[Any], shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> None:
        size, rank = data_parallel_size_and_rank()
        super().__init__(
            dataset, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )

    def __iter__(self) -> Iterator[Any]:
        indices = super().__iter__()
        if self.shuffle:
            self.epoch += 1  # the next pass reshuffles without a set_epoch call
        return indices


def data_parallel_size_and_rank() -> tuple[int, int]:
    """The DATA group's size and this rank's place in it (``(1, 0)`` without one)."""
    if not gpc.is_initialized(ParallelMode.DATA):
        return 1, 0
    return gpc.get_world_size(ParallelMode.DATA), gpc.get_local_rank(ParallelMode.DATA)


class _WorkerSeeder:
    """Seeds python's and numpy's RNGs in a loader worker from torch's per-worker seed (derived
    from the loader's generator), then runs the user's ``worker_init_fn``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        seed = torch.initial_seed() % 2**32
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def get_dataloader(
    dataset: Dataset[Any],
    shuffle: bool = False,
    seed: int = 1024,
    add_sampler: bool = True,
    drop_last: bool = False,
    pin_memory: bool = False,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader[Any]:
    """A deterministic ``DataLoader``: this DATA rank's share of ``dataset`` (a
    :class:`DataParallelSampler`) when the DATA group has more than one rank and ``add_sampler``
    is on, else the whole dataset.

    ``seed`` fixes the shuffle order and the workers' random states: the same on the ranks of
    one tensor/pipeline group (so the first and last pipeline stages read matching inputs and
    labels even when shuffling), and on every rank when the loader reads the whole dataset.

    Args:
        dataset: the dataset.
        shuffle: shuffle the samples (a new order each epoch).
        seed: seed of the shuffle order and of the loader workers.
        add_sampler: shard over the DATA group; ``False`` for a test set every rank reads whole.
        drop_last: drop the last incomplete batch (and, when sharding, the tail that does not
            divide evenly over the DATA ranks, instead of padding it).
        pin_memory: pin batches in host memory (ignored on a CPU-only machine, where there is
            no device to copy to).
        num_workers: loader worker processes.
        **kwargs: other ``torch.utils.data.DataLoader`` arguments (``batch_size``,
            ``collate_fn``, ``worker_init_fn`` — called after the seeding — ``generator`` ...).

    Returns:
        The loader; ``loader.sampler.set_epoch(epoch)`` is available when sharding.

    Raises:
        ValueError: a negative ``num_workers``, or a ``sampler`` passed while ``add_sampler``
            would add one.

    Example:
        >>> loader = get_dataloader(list(range(8)), batch_size=4)
        >>> [b.tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} must be an int >= 0.")
    dp_size, dp_rank = data_parallel_size_and_rank()
    use_sampler = add_sampler and dp_size > 1
    if use_sampler and "sampler" in kwargs:
        raise ValueError(
            "get_dataloader got a sampler while add_sampler=True would add a DataParallelSampler; "
            "pass add_sampler=False to use your own."
        )
    generator = kwargs.pop("generator", None)
    if generator is None:
        generator = torch.Generator()
        # sharded: each DATA rank its own worker streams; whole: every rank the same order
        generator.manual_seed(seed + dp_rank if use_sampler else seed)
    options: dict[str, Any] = dict(
        worker_init_fn=_WorkerSeeder(kwargs.pop("worker_init_fn", None)),
        drop_last=drop_last,
        pin_memory=pin_memory and get_accelerator().name != "cpu",
        num_workers=num_workers,
        generator=generator,
        **kwargs,
    )
    if use_sampler:
        sampler = DataParallelSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, sampler=sampler, **options)
    return DataLoader(dataset, shuffle=shuffle, **options)
