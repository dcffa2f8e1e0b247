"""``kolossos.launch(config=...)`` fills the legacy global context: the groups of the
``parallel`` key laid out as Colossal-AI's initializers lay them out, the per-mode seeds, and
the documented extension recipe (a user initializer picked up by a config key)."""

from __future__ import annotations

from enum import Enum
from typing import Any

import pytest
import torch
import torch.distributed as dist

import kolossos
from kolossos.constants import INITIALIZER_MAPPING
from kolossos.context import Config, ParallelMode, ProcessGroupInitializer
from kolossos.context.random import seed
from kolossos.core import global_context as gpc
from kolossos.registry import DIST_GROUP_INITIALIZER
from kolossos.testing import spawn

M = ParallelMode
# mode -> every group of that mode, as Colossal-AI v0.2.8 builds them on 4 ranks
CASES: dict[str, tuple[dict[str, Any], dict[ParallelMode, list[list[int]]]]] = {
    "data": (dict(data=4), {M.DATA: [[0, 1, 2, 3]], M.TENSOR: [[0], [1], [2], [3]]}),
    "pipeline": (
        dict(pipeline=2),
        {M.DATA: [[0, 2], [1, 3]], M.PIPELINE: [[0, 1], [2, 3]], M.MODEL: [[0, 1], [2, 3]]},
    ),
    "1d": (
        dict(tensor=dict(size=2, mode="1d")),
        {M.DATA: [[0, 2], [1, 3]], M.TENSOR: [[0, 1], [2, 3]], M.PARALLEL_1D: [[0, 1], [2, 3]]},
    ),
    "2d": (
        dict(tensor=dict(size=4, mode="2d")),
        {M.PARALLEL_2D_ROW: [[0, 1], [2, 3]], M.PARALLEL_2D_COL: [[0, 2], [1, 3]]},
    ),
    "2.5d": (
        dict(tensor=dict(size=4, mode="2.5d", depth=1)),
        {
            M.PARALLEL_2P5D_ROW: [[0, 1], [2, 3]],
            M.PARALLEL_2P5D_COL: [[0, 2], [1, 3]],
            M.PARALLEL_2P5D_DEP: [[0], [1], [2], [3]],
            M.PARALLEL_2P5D_XZ: [[0, 2], [1, 3]],
        },
    ),
    "sequence": (
        dict(tensor=dict(size=2, mode="sequence")),
        {M.SEQUENCE: [[0, 1], [2, 3]], M.SEQUENCE_DP: [[0, 1, 2, 3]]},
    ),
}


def _draws() -> dict[str, float]:
    out = {}
    for mode in (M.GLOBAL, M.DATA, M.TENSOR):
        with seed(mode):
            out[mode.value] = float(torch.rand(1).item())
    return out


def _layout(rank: int, world_size: int, port: int, case: str) -> dict[str, Any]:
    parallel, expected = CASES[case]
    kolossos.launch(
        config=dict(parallel=parallel, BATCH_SIZE=4), rank=rank, world_size=world_size,
        host="localhost", port=port, verbose=False,
    )  # fmt: skip
    assert gpc.config.BATCH_SIZE == 4 and gpc.get_global_rank() == rank
    assert gpc.get_world_size(M.GLOBAL) == world_size
    for mode, groups in expected.items():
        mine = next(g for g in groups if rank in g)
        assert gpc.is_initialized(mode), mode
        assert gpc.get_ranks_in_group(mode) == mine, mode
        assert gpc.get_local_rank(mode) == mine.index(rank)
        assert gpc.get_world_size(mode) == len(mine)
        assert dist.get_process_group_ranks(gpc.get_group(mode)) == mine
        assert gpc.get_cpu_group(mode) is gpc.get_group(mode)  # gloo: its own twin
        assert gpc.is_first_rank(mode) == (mine[0] == rank)
        assert gpc.is_last_rank(mode) == (mine[-1] == rank)
    size = gpc.data_parallel_size * gpc.pipeline_parallel_size * gpc.tensor_parallel_size
    assert size == world_size
    t = torch.ones(1)
    dist.all_reduce(t, group=gpc.get_group(M.DATA))
    assert t.item() == gpc.data_parallel_size
    tp_rank = gpc.get_local_rank(M.TENSOR)
    draws = _draws()
    gpc.destroy()
    return {"tp_rank": tp_rank, **draws}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_groups_match_upstream_layouts(case: str) -> None:
    results = spawn(_layout, 4, case=case)
    assert len({r["global"] for r in results}) == 1
    assert len({r["data"] for r in results}) == 1
    by_tp: dict[int, set[float]] = {}
    for r in results:
        by_tp.setdefault(r["tp_rank"], set()).add(r["tensor"])
    if case == "1d":  # ranks of one TP group draw differently, peers at one TP rank alike
        assert len(by_tp) == 2 and all(len(v) == 1 for v in by_tp.values())
        assert by_tp[0] != by_tp[1]


class NewMode(Enum):
    """A user's parallel mode (a new key, since ParallelMode cannot grow members)."""

    NEW_MODE = "new_mode"


class MyParallelInitializer(ProcessGroupInitializer):
    """The documented recipe: six fixed arguments, then extra ones from the config."""

    def __init__(
        self, rank: int, world_size: int, config: Config, data_parallel_size: int,
        pipeline_parallel_size: int, tensor_parallel_size: int, arg1: int, arg2: str,
    ) -> None:  # fmt: skip
        super().__init__(rank, world_size, config)
        self.arg1, self.arg2 = arg1, arg2
        self.tp = tensor_parallel_size

    def init_parallel_groups(self) -> Any:
        groups = [list(range(i, i + self.tp)) for i in range(0, self.world_size, self.tp)]
        return self.build_groups(groups, NewMode.NEW_MODE)


def _extension(rank: int, world_size: int, port: int) -> tuple[Any, ...]:
    if not DIST_GROUP_INITIALIZER.has("MyParallelInitializer"):
        DIST_GROUP_INITIALIZER.register_module(MyParallelInitializer)
    INITIALIZER_MAPPING["new_mode"] = "MyParallelInitializer"
    config = dict(
        parallel=dict(pipeline=dict(size=1), tensor=dict(size=2, mode="new_mode", arg1=7, arg2="x"))
    )
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    out = (gpc.get_ranks_in_group(NewMode.NEW_MODE), gpc.get_local_rank(NewMode.NEW_MODE))
    gpc.destroy()
    return out


@pytest.mark.dist
def test_extension_recipe() -> None:
    assert spawn(_extension, 2) == [([0, 1], 0), ([0, 1], 1)]


def _data_only(rank: int, world_size: int, port: int) -> tuple[int, int, bool]:
    kolossos.launch({"LR": 0.1}, rank, world_size, "localhost", port, verbose=False)
    with seed(M.DATA):
        torch.rand(1)
    out = (gpc.get_world_size(M.DATA), gpc.get_local_rank(M.DATA), gpc.is_initialized(M.TENSOR))
    assert gpc.config.LR == 0.1
    return out


@pytest.mark.dist
def test_without_parallel_key_gpc_knows_the_world() -> None:
    assert spawn(_data_only, 2) == [(2, 0, False), (2, 1, False)]
