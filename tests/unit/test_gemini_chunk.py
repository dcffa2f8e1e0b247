"""Gemini chunks without a process group: the tensor-state table, packing, and the chunk-size
search on GPT-2 small / medium parameter shapes (built on the meta device)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from kolossos.zero.gemini.chunk import (
    TRANSITIONS,
    ChunkManager,
    InvalidTransitionError,
    TensorState,
    check_transition,
    find_chunk_configuration,
    search_chunk_size,
    tied_params,
)

S = TensorState


def test_transition_table_is_total_and_checked() -> None:
    assert set(TRANSITIONS) == set(TensorState)
    # the documented life cycle of one training iteration
    cycle = [S.FREE, S.HOLD, S.COMPUTE, S.HOLD_AFTER_FWD, S.FREE, S.COMPUTE,
             S.READY_FOR_REDUCE, S.HOLD_AFTER_BWD, S.FREE]  # fmt: skip
    for old, new in itertools.pairwise(cycle):
        check_transition(old, new)
    wrong = [(S.COMPUTE, S.FREE), (S.READY_FOR_REDUCE, S.FREE),
             (S.READY_FOR_REDUCE, S.COMPUTE), (S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD)]  # fmt: skip
    for old, new in wrong:
        with pytest.raises(InvalidTransitionError, match=f"{old.name} -> {new.name}"):
            check_transition(old, new)


def test_packing_in_initialisation_order_with_ties() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight  # tied: appears once
    named = list(model.named_parameters())
    manager = ChunkManager(named, 16, torch.float16, None, torch.device("cpu"))
    layout = [[info.name for info in c.tensors] for c in manager.chunks]
    assert layout == [["0.weight"], ["1.weight", "1.bias"]]  # 40 > 16: a chunk of its own
    assert [c.chunk_size for c in manager.chunks] == [40, 15]  # the last chunk cut to size
    assert manager.locate(model[2].weight)[1].name == "0.weight"
    chunk = manager.chunks[1]
    assert chunk.chunk_mem == 30 and chunk.shard_mem == 30 and not chunk.is_gathered
    assert all(info.state is S.FREE for info in chunk.tensors)


def test_tied_parameter_packed_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Embedding(10, 4), nn.Linear(4, 3),
                          nn.Linear(4, 10, bias=False))  # fmt: skip
    model[3].weight = model[1].weight
    assert tied_params(model) == {model[1].weight}
    named = list(model.named_parameters())
    manager = ChunkManager(named, 64, torch.float16, None, torch.device("cpu"),
                           alone=tied_params(model))  # fmt: skip
    layout = [[info.name for info in c.tensors] for c in manager.chunks]
    assert layout == [["0.weight", "0.bias"], ["1.weight"], ["2.weight", "2.bias"]]
    assert [c.chunk_size for c in manager.chunks] == [64, 40, 15]  # the lone one cut to size
    # the search simulates the same packing: the room left before the lone one is the waste
    assert search_chunk_size([20, 40, 15], 0, 64, 1, alone=[False, True, False]) == (64, 44)
    assert search_chunk_size([20, 40, 15], 0, 64, 1) == (64, 4)


def test_search_minimises_waste() -> None:
    # sizes 6, 6, 6, 6: chunk size 12 packs two per chunk without gaps; 10 wastes 4 per chunk
    assert search_chunk_size([6, 6, 6, 6], search_range=4, min_chunk_size=10, interval=1) == (12, 0)
    assert search_chunk_size([3, 4], search_range=100, min_chunk_size=10, interval=1) == (7, 0)
    with pytest.raises(ValueError, match="interval=0"):
        search_chunk_size([3], 1, 1, 0)


@pytest.mark.parametrize(("n_embd", "n_layer", "n_head"), [(768, 12, 12), (1024, 24, 16)])
def test_search_wastes_under_two_percent_on_gpt2(n_embd: int, n_layer: int, n_head: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head))
    for hidden_dim in (None, n_embd):
        config, result = find_chunk_configuration(model, 32, 32, hidden_dim=hidden_dim)
        assert result.used == sum(p.numel() for p in model.parameters())  # tied wte counted once
        assert result.wasted_percentage < 2.0, result.report()
        assert 32 * 2**20 <= config["chunk_size"] <= 64 * 2**20
        # the packing the manager does wastes what the search predicted
        named = list(model.named_parameters())
        manager = ChunkManager(named, config["chunk_size"], torch.float16, None,
                               torch.device("cpu"), alone=tied_params(model))  # fmt: skip
        capacity = sum(c.chunk_size for c in manager.chunks)
        assert capacity - result.used == result.wasted
        # the tied embedding alone, cut to its size: the LM head gathers nothing else
        assert [i.name for i in manager.chunks[0].tensors] == ["transformer.wte.weight"]
        assert manager.chunks[0].chunk_size == model.transformer.wte.weight.numel()
    assert "used number: 118.68 MB" in result.report() or n_embd != 768


def test_small_models_go_into_one_chunk() -> None:
    config, result = find_chunk_configuration(nn.Linear(64, 64), 1, 0.01)
    assert config == {"chunk_size": 64 * 64 + 64, "keep_gathered": False}
    assert result.wasted == 0 and result.report().startswith("searching chunk configuration")


def test_gemini_ddp_rejects_bad_arguments_before_any_collective() -> None:
    from kolossos.zero.gemini import GeminiDDP

    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"mixed_precision": torch.int8}, ValueError, "mixed_precision"),
        ({"chunk_config_dict": {"chunk_size": 0}}, ValueError, "chunk_config_dict"),
        ({"chunk_config_dict": {"size": 8}}, ValueError, "chunk_size"),
        ({"search_range_m": 1, "search_range_mb": 2}, ValueError, "search_range_mb"),
        ({"device": "meta"}, ValueError, "device='meta'"),
        ({"chunk_init_device": "meta"}, ValueError, "chunk_init_device"),
        ({"placement_policy": "nowhere"}, ValueError, "nowhere"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            GeminiDDP(nn.Linear(4, 4), **kwargs)  # type: ignore[arg-type]


def test_gemini_ddp_trains_in_one_process() -> None:
    """Without a process group Gemini is a single-rank ZeRO-3: same result as plain AdamW."""
    from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 64}, mixed_precision=torch.float32)
    assert [c.utilized for c in gemini.chunk_manager.chunks] == [128, 16, 64, 4]  # in order
    assert all(p.numel() == 0 for p in model.parameters())  # released between uses
    opt = GeminiOptimizer(torch.optim.AdamW(gemini.parameters(), lr=0.1), gemini)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    for _ in range(2):
        opt.backward(gemini(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        reference(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    opt.backward(gemini(x).pow(2).mean())
    opt.zero_grad(set_to_none=False)  # zeroed, kept: as torch's zero_grad(set_to_none=False)
    assert all(c.grad_shard is not None and not c.grad_shard.any() for c in gemini.chunk_manager)
    opt.zero_grad()
    assert all(c.grad_shard is None for c in gemini.chunk_manager)
    state = gemini.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(state[name], p)
    # a fresh wrap loads the full state dict and computes what the reference computes
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fresh = GeminiDDP(net, chunk_config_dict={"chunk_size": 48}, mixed_precision=torch.float32)
    fresh.load_state_dict(reference.state_dict())
    torch.testing.assert_close(fresh(x), reference(x))
    fresh.to("cpu").float()  # no-ops are allowed
    with pytest.raises(NotImplementedError, match="mixed_precision"):
        fresh.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="missing keys"):
        fresh.load_state_dict({"0.weight": reference[0].weight})


@pytest.mark.parametrize("shard_param_frac", [1.0, 0.0])
def test_gradients_overwrite_the_payload_of_trainable_sharded_chunks(
    shard_param_frac: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded chunk whose tensors are all trainable reduces its gradients from its own
    payload; one with a frozen tensor, or kept gathered, from a buffer of its own. Training still
    computes what plain AdamW computes, and the released payloads are re-made from the masters."""
    from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer
    from kolossos.zero.gemini.chunk import Chunk

    in_payload: dict[int, bool] = {}
    reduce = Chunk.reduce

    def spy(chunk: Chunk) -> None:
        in_payload[chunk.chunk_id] = chunk.grad_payload is chunk.payload
        reduce(chunk)

    monkeypatch.setattr(Chunk, "reduce", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    for net in (model, reference):
        net[0].bias.requires_grad_(False)  # chunk 1 = [0.bias (frozen), 2.weight]
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 80}, mixed_precision=torch.float32,
                       shard_param_frac=shard_param_frac)  # fmt: skip
    assert [[i.name for i in c.tensors] for c in gemini.chunk_manager] == [
        ["0.weight"],
        ["0.bias", "2.weight"],
        ["2.bias"],
    ]
    trainable = [p for p in reference.parameters() if p.requires_grad]
    opt = GeminiOptimizer(torch.optim.AdamW(gemini.parameters(), lr=0.1), gemini)
    ref_opt = torch.optim.AdamW(trainable, lr=0.1)
    x = torch.randn(5, 8)
    for _ in range(3):
        loss = gemini(x).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = reference(x).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss)
    sharded = shard_param_frac == 1.0
    assert in_payload == {0: sharded, 1: False, 2: sharded}
    state = gemini.state_dict()
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(state[name], p)


def test_nothing_is_prefetched_over_the_loss() -> None:
    """From the second iteration the next chunk is prefetched, in forward and in backward, but
    at the end of forward only the chunk backward starts with is gathered (held): the chunk
    backward needs next is fetched once backward has started, not beside the loss."""
    from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 72}, mixed_precision=torch.float32)
    manager = gemini.chunk_manager
    opt = GeminiOptimizer(torch.optim.AdamW(gemini.parameters(), lr=0.1), gemini)
    x = torch.randn(5, 8)
    for step in range(3):
        loss = gemini(x).pow(2).mean()
        if step:
            assert [c.is_gathered for c in manager] == [False, False, True]
        prefetched = manager.prefetches
        opt.backward(loss)
        assert manager.prefetches - prefetched == (2 if step else 0)  # chunks 1 and 0
        opt.step()
        opt.zero_grad()
    assert gemini.hooks.order == [0, 1, 2, 1, 0] and gemini.hooks.forward_len == 3
