"""``get_dataloader`` shards over the global context's DATA group only: the ranks of one tensor
(or pipeline) group read identical batches and the DATA groups partition the dataset; the
``is_using_*`` answers follow the config; ``Accuracy`` over logits split by 1D tensor
parallelism counts what it counts on the whole logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import kolossos
import kolossos.nn as col_nn
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.nn.metric import Accuracy
from kolossos.testing import spawn
from kolossos.utils import get_dataloader, is_using_ddp, is_using_pp, is_using_sequence

N = 22  # not a multiple of the DATA size: the sampler pads


def _epoch(loader: DataLoader[Any]) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def _launch(rank: int, world_size: int, port: int, parallel: dict[str, Any] | None) -> None:
    config: dict[str, Any] = {} if parallel is None else dict(parallel=parallel)
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)


def _read() -> dict[str, Any]:
    dataset = TensorDataset(torch.arange(N))
    loader = get_dataloader(dataset, shuffle=True, seed=7, batch_size=3)
    whole = get_dataloader(dataset, shuffle=True, seed=7, add_sampler=False, batch_size=3)
    out = dict(
        epochs=[_epoch(loader), _epoch(loader)],
        whole=_epoch(whole),
        flags=(is_using_ddp(), is_using_pp(), is_using_sequence()),
        dp=(gpc.get_world_size(ParallelMode.DATA), gpc.get_local_rank(ParallelMode.DATA)),
    )
    return out


def _loading(rank: int, world_size: int, port: int, parallel: dict[str, Any] | None) -> Any:
    _launch(rank, world_size, port, parallel)
    out = _read()
    gpc.destroy()
    return out


def _check_partition(results: list[dict[str, Any]]) -> None:
    dp_size = results[0]["dp"][0]
    share = -(-N // dp_size)  # padded to a multiple of the DATA size
    for epoch in range(2):
        by_dp: dict[int, list[int]] = {}
        for r in results:  # ranks at one DATA rank (one TP/PP group) read the same batches
            assert by_dp.setdefault(r["dp"][1], r["epochs"][epoch]) == r["epochs"][epoch]
        assert all(len(part) == share for part in by_dp.values())
        union = [i for part in by_dp.values() for i in part]
        assert sorted(set(union)) == list(range(N)) and len(union) == share * dp_size
    assert results[0]["epochs"][0] != results[0]["epochs"][1], "a new order every pass"
    assert all(sorted(r["whole"]) == list(range(N)) for r in results)
    assert len({tuple(r["whole"]) for r in results}) == 1  # add_sampler=False: same, whole


@pytest.mark.dist
def test_two_ranks_data_parallel() -> None:
    results = spawn(_loading, 2, parallel=None)
    assert [r["dp"] for r in results] == [(2, 0), (2, 1)]
    assert all(r["flags"] == (True, False, False) for r in results)
    _check_partition(results)


@pytest.mark.dist
def test_two_pipeline_stages_read_the_same_batches() -> None:
    results = spawn(_loading, 2, parallel=dict(pipeline=2))
    assert all(r["flags"] == (False, True, False) and r["dp"] == (1, 0) for r in results)
    assert results[0]["epochs"] == results[1]["epochs"]  # inputs on stage 0, labels on stage 1
    _check_partition(results)


def _tensor_1d(rank: int, world_size: int, port: int) -> dict[str, Any]:
    _launch(rank, world_size, port, parallel=dict(tensor=dict(size=2, mode="1d")))
    out = _read()
    tp_rank, tp_group = gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_group(ParallelMode.TENSOR)
    torch.manual_seed(0)  # the same batch on both ranks of a tensor group
    x, targets = torch.randn(64, 8), torch.randint(0, 6, (64,))
    head = col_nn.Linear(8, 6)  # column-parallel: each rank holds 3 of the 6 classes
    split = head(x)
    assert split.shape == (64, 3)
    parts = [torch.empty_like(split) for _ in range(2)]
    dist.all_gather(parts, split, group=tp_group)
    whole = torch.cat(parts, dim=-1)
    metric = Accuracy()  # follows the layers: the logits are split
    assert metric.parallel_output
    out["split"] = (
        int(metric(split, targets)),
        int(Accuracy(parallel_output=False)(whole, targets)),
    )
    # ties across ranks and uneven widths: rank 0 holds classes 0-3, rank 1 classes 4-5
    full = torch.tensor(
        [[0, 2, 1, 0, 2, 0], [0, 0, 0, 0, 0, 5], [3, 0, 0, 0, 3, 3], [1, 1, 1, 1, 1, 1]],
        dtype=torch.float32,
    )
    labels = torch.tensor([1, 5, 0, 0])  # every row right only if ties go to the lowest class
    mine = full[:, :4] if tp_rank == 0 else full[:, 4:]
    out["ties"] = int(Accuracy(parallel_output=True)(mine, labels))
    gpc.destroy()
    return out


@pytest.mark.dist
def test_four_ranks_tensor_1d_groups_share_data_and_accuracy() -> None:
    results = spawn(_tensor_1d, 4)
    assert [r["dp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]  # TP [0,1], [2,3]
    assert all(r["flags"] == (True, False, False) for r in results)
    _check_partition(results)
    assert results[0]["epochs"] == results[1]["epochs"] != results[2]["epochs"]
    for r in results:
        assert r["split"][0] == r["split"][1], r["split"]
        assert r["ties"] == 4
