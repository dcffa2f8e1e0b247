"""Colossal-AI's ZeRO / Gemini names without a process group: ``conditional_context``,
``search_chunk_configuration`` (upstream's rule and return value), ``init_chunk_manager``,
``GeminiManager``, ``ChunkFullError``, ``LowLevelZeroOptimizer``'s new arguments, and
``GeminiDDP.state_dict`` / ``get_static_torch_model`` in one process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

from kolossos.utils import conditional_context
from kolossos.zero import LowLevelZeroOptimizer, get_static_torch_model
from kolossos.zero.gemini import GeminiDDP, GeminiManager
from kolossos.zero.gemini.chunk import (
    Chunk,
    ChunkFullError,
    classify_params_by_dp_degree,
    flat_chunk_config,
    init_chunk_manager,
    search_chunk_configuration,
)
from kolossos.zero.gemini.memory_tracer import MemStats

MI = 2**20


def test_conditional_context_enters_only_when_enabled() -> None:
    entered: list[str] = []

    @contextlib.contextmanager
    def recording(tag: str) -> Iterator[None]:
        entered.append(f"enter {tag}")
        yield
        entered.append(f"exit {tag}")

    with conditional_context(recording("a")):
        entered.append("body a")
    with conditional_context(recording("b"), enable=False):
        entered.append("body b")
    with conditional_context(torch.no_grad(), enable=True):
        assert not torch.is_grad_enabled()
    assert entered == ["enter a", "body a", "exit a", "body b"]


class Sizes(nn.Module):
    """A module whose parameters have the given numbers of elements, in order."""

    def __init__(self, *numels: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in numels)


def search(model: nn.Module, range_m: float, interval: int, **kwargs: object) -> tuple:
    return search_chunk_configuration(model, range_m, interval, **kwargs)  # type: ignore[arg-type]


def waste_of(sizes: list[int], chunk_size: int) -> int:
    """Upstream's waste, one size at a time: the room left when a parameter opens a chunk,
    plus the room left in the last chunk."""
    waste, left = 0, 0
    for n in sizes:
        if n > left:
            waste, left = waste + left, chunk_size
        left -= n
    return waste + left


def test_search_returns_upstreams_triple_keyed_by_degree() -> None:
    model = Sizes(6, 6, 6, 6)  # chunk size 6: no room left anywhere
    config, total, waste = search(model, 6 / MI, 1, min_chunk_size_m=0, filter_exlarge_params=False)
    assert (config, total, waste) == ({1: {"chunk_size": 6, "keep_gathered": False}}, 24, 0)
    # candidates from the largest size rounded up to the interval: 6, 8, 10
    # 6: [5][4][3] wastes 1 + 2 + 3; 8: [5][4,3] wastes 3 + 1; 10: [5,4][3] wastes 1 + 7
    config, total, waste = search(Sizes(5, 4, 3), 4 / MI, 2, min_chunk_size_m=0,
                                  filter_exlarge_params=False)  # fmt: skip
    assert (config[1]["chunk_size"], total, waste) == (8, 12, 4)


def test_search_picks_the_first_least_wasting_candidate() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        sizes = torch.randint(1, 50, (12,), generator=gen).tolist()
        interval = int(torch.randint(1, 7, (1,), generator=gen))
        config, total, waste = search(Sizes(*sizes), 60 / MI, interval, min_chunk_size_m=0,
                                      filter_exlarge_params=False)  # fmt: skip
        start = -(-max(sizes) // interval) * interval
        candidates = range(start, start + 61, interval)
        best = min(candidates, key=lambda c: waste_of(sizes, c))  # min: the first minimum
        assert (config[1]["chunk_size"], waste) == (best, waste_of(sizes, best))
        assert total == sum(sizes)


def test_search_small_models_are_one_kept_gathered_chunk() -> None:
    config, total, waste = search(nn.Linear(64, 64), 1, 1024)  # far below min_chunk_size_m=32
    assert config == {1: {"chunk_size": 64 * 64 + 64, "keep_gathered": True}}
    assert (total, waste) == (64 * 64 + 64, 0)
    assert search(nn.Module(), 1, 1024) == ({}, 0, 0)


def test_search_filters_extra_large_parameters() -> None:
    model = Sizes(*([10] * 20), 1000)  # 1000 > mean + 3 std: left out of the search
    kept, _, _ = search(model, 0, 5, min_chunk_size_m=0)
    assert kept[1]["chunk_size"] == 10
    unfiltered, _, _ = search(model, 0, 5, min_chunk_size_m=0, filter_exlarge_params=False)
    assert unfiltered[1]["chunk_size"] == 1000


def test_search_matches_upstreams_gpt2_test() -> None:
    """Colossal-AI's tests/test_zero/test_gemini/test_search.py: its tiny GPT-2 LM gets 527872."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=50258)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    found, total, _ = search_chunk_configuration(
        model, search_range_m=1, search_interval=128, min_chunk_size_m=0, filter_exlarge_params=True
    )
    assert found == {1: {"chunk_size": 527872, "keep_gathered": False}}
    assert total == sum(p.numel() for p in model.parameters())  # tied wte counted once
    manager = init_chunk_manager(model, "cpu", hidden_dim=128, search_range_m=1,
                                 min_chunk_size_m=0, strict_ddp_flag=True)  # fmt: skip
    assert manager.dp_degree_chunk_size_dict == {1: 527872}


def test_search_rejects_bad_arguments() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"search_interval=0\.5 must be an int"):
        search(model, 1, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="search_interval=0 must be > 0"):
        search(model, 1, 0)
    with pytest.raises(ValueError, match="search_range_m=-1"):
        search(model, -1, 8)
    with pytest.raises(NotImplementedError, match="memstas"):
        search(model, 1, 8, memstas=MemStats())
    with pytest.raises(ValueError, match="pass hidden_dim"):
        init_chunk_manager(model, "cpu", search_range_m=1, search_interval=8)


def test_classify_and_flat_config() -> None:
    params = list(nn.Linear(2, 2).parameters())
    assert classify_params_by_dp_degree(params) == {1: params}
    keyed = {1: {"chunk_size": 8, "keep_gathered": False}}
    assert flat_chunk_config(keyed) == {"chunk_size": 8, "keep_gathered": False}
    assert flat_chunk_config({"chunk_size": 8}) == {"chunk_size": 8}
    with pytest.raises(ValueError, match="group has 2 ranks"):
        flat_chunk_config(keyed, world_size=2)
    with pytest.raises(ValueError, match="exactly one entry"):
        flat_chunk_config({1: {"chunk_size": 8}, 2: {"chunk_size": 8}})


def test_init_chunk_manager_packs_without_touching_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    before = [p.detach().clone() for p in model.parameters()]
    small = init_chunk_manager(model, "cpu", search_range_m=1, verbose=True)
    assert "searching chunk configuration is completed" in capsys.readouterr().out
    assert [c.keep_gathered for c in small] == [True]  # below min_chunk_size_m
    manager = init_chunk_manager(model, "cpu", hidden_dim=64, search_range_m=0.01,
                                 min_chunk_size_m=0)  # fmt: skip
    assert [info.name for c in manager for info in c.tensors][:2] == ["0.weight", "0.bias"]
    assert manager.dtype == torch.float32 and not any(c.keep_gathered for c in manager)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_chunk_full_error() -> None:
    chunk = Chunk(0, 8, torch.float32, None, torch.device("cpu"))
    chunk.append(nn.Parameter(torch.zeros(6)), "a")
    with pytest.raises(ChunkFullError, match="2 free elements, b needs 3"):
        chunk.append(nn.Parameter(torch.zeros(3)), "b")


def test_gemini_manager_drives_a_policy() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    manager = init_chunk_manager(model, "cpu", hidden_dim=32, search_range_m=0, min_chunk_size_m=0)
    static = GeminiManager("static", manager)
    assert (static.policy_name, static.need_warmup, static.is_warmup()) == ("static", False, True)
    static.adjust_layout(tuple(manager.chunks))
    static.post_iter()
    assert not static.is_warmup() and static.cuda_margin_mem is None
    with pytest.raises(RuntimeError, match="collects no memory statistics"):
        static.memstats()
    with pytest.raises(ValueError, match="no effect"):
        GeminiManager("auto", manager, offload_optim_frac=0.5)

    auto = GeminiManager("auto", manager, device_memory_budget=2**20)
    assert auto.need_warmup and auto.is_cuda_margin_mem_avail
    with pytest.raises(RuntimeError, match="post_iter"):
        auto.memstats()
    for chunk in manager:  # one compute moment per chunk, as GeminiDDP's hooks would
        auto.adjust_layout((chunk,))
    auto.post_iter()
    stats = auto.memstats()
    assert stats.access_order == [(c.chunk_id,) for c in manager]
    assert auto.cuda_margin_mem is not None and auto.cuda_margin_mem > 0


def test_low_level_zero_refuses_unsupported_arguments_before_any_collective() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(NotImplementedError, match="moe_extra_dp_process_group"):
        LowLevelZeroOptimizer(
            torch.optim.SGD(params, lr=0.1),
            moe_extra_dp_process_group=object(),  # type: ignore[arg-type]
        )
    with pytest.raises(NotImplementedError, match="tp_process_group"):
        LowLevelZeroOptimizer(
            torch.optim.SGD(params, lr=0.1),
            tp_process_group=object(),  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match="master_weights='no' must be True or False"):
        LowLevelZeroOptimizer(torch.optim.SGD(params, lr=0.1), master_weights="no")  # type: ignore[arg-type]


def test_plugin_config_carries_master_weights() -> None:
    from kolossos.zero.low_level.config import LowLevelZeroConfig

    assert LowLevelZeroConfig().optimizer_kwargs()["master_weights"] is True
    assert LowLevelZeroConfig(master_weights=False).optimizer_kwargs()["master_weights"] is False
    with pytest.raises(TypeError, match="master_weights"):
        LowLevelZeroConfig(master_weights=1)  # type: ignore[arg-type]


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = emb.weight
    return nn.Sequential(emb, nn.Linear(6, 6), nn.BatchNorm1d(6), head)


def test_gemini_state_dict_in_one_process() -> None:
    model = _tied()
    reference = _tied()
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 40}, mixed_precision=torch.bfloat16)
    state = gemini.state_dict()  # only_rank_0=True: rank 0 here
    expected = reference.state_dict()
    assert list(state) == list(expected)  # torch's keys and order, tied name included
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, check_dtype=False)
    assert state["0.weight"].dtype == torch.float32 and state["3.weight"] is state["0.weight"]
    assert state._metadata[""] == {"version": model._version}  # type: ignore[attr-defined]
    assert list(gemini.state_dict(prefix="m.")) == [f"m.{k}" for k in expected]
    with pytest.raises(NotImplementedError, match="keep_vars=True"):
        gemini.state_dict(keep_vars=True)
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in expected.items()}
    assert gemini.load_state_dict(changed) == ([], [])
    for name, value in gemini.state_dict(only_rank_0=False).items():
        torch.testing.assert_close(value, changed[name], check_dtype=False)


def test_static_torch_model_in_one_process() -> None:
    model = _tied()
    reference = _tied().eval()
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 40}, mixed_precision=torch.float32)
    plain = get_static_torch_model(gemini, dtype=torch.float64).eval()
    assert isinstance(plain, nn.Sequential) and plain[3].weight is plain[0].weight
    assert all(p.dtype == torch.float64 and p.numel() for p in plain.parameters())
    x = torch.arange(8) % 10
    torch.testing.assert_close(plain(x).float(), reference(x))
    assert all(p.numel() == 0 for p in model.parameters())  # the Gemini model is unchanged
    with pytest.raises(TypeError, match="needs a GeminiDDP"):
        get_static_torch_model(reference)  # type: ignore[arg-type]
