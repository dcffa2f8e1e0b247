"""``InferenceEngine`` with ``tp_size=2, pp_size=2`` on 4 CPU/gloo ranks against ``generate``.

One spawned job: GPT-2, OPT and LLaMA (2 layers, hidden 32, 4 heads, LLaMA with 2 KV heads; the
models and left-padded batch of ``test_inference_generate.py``), KV cache on and off, with and
without an EOS that fires mid-way in one row. Greedy output must equal transformers' ``generate``
on the whole model token for token (``torch.equal``) on all four ranks. Each stage holds one of
the two blocks, split by head over its two tensor-parallel ranks: its cache has one layer with
half the (KV) heads. Seeded sampling gives the one-process engine's tokens on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_inference_generate import FAMILIES, HEADS, NEW, build, prompts, reference

from kolossos.inference import InferenceConfig, InferenceEngine, SamplingConfig
from kolossos.testing import distributed

pytestmark = pytest.mark.dist

TP_PP = InferenceConfig(tp_size=2, pp_size=2)


def check_split(engine: InferenceEngine, family: str) -> None:
    """Ranks 0, 1 are stage 0 and 2, 3 stage 1; one block per stage, half its heads per rank."""
    stage = engine._stage
    assert stage is not None and stage.stage == dist.get_rank() // 2
    blocks = [m for m in engine.model.modules() if type(m).__name__.endswith(("Block", "Layer"))]
    assert len(blocks) == 1, (family, [type(m).__name__ for m in blocks])
    cache = stage(torch.tensor([[1, 2, 3]]), use_cache=True)[engine.cache_keyword]
    kv_heads = getattr(engine.model.config, "num_key_value_heads", HEADS)  # LLaMA: 2
    assert len(cache.layers) == 1
    assert cache.layers[0].keys.shape[1:3] == (kv_heads // 2, 3), cache.layers[0].keys.shape
    mine = sum(p.numel() for p in engine.model.parameters())
    torch.manual_seed(0)
    assert mine < sum(p.numel() for p in FAMILIES[family]().parameters())
    stage_sizes = [torch.zeros((), dtype=torch.long) for _ in range(4)]
    dist.all_gather(stage_sizes, torch.tensor(mine))
    assert stage_sizes[0] == stage_sizes[1] and stage_sizes[2] == stage_sizes[3]


@distributed(4)
def test_tp_pp_greedy_equals_transformers_generate() -> None:
    ids, mask = prompts()
    checked = 0
    for family in FAMILIES:
        model = build(family)
        free = reference(model, ids, mask, use_cache=True)
        assert free.shape[1] == ids.shape[1] + NEW  # EOS 99 never fired
        eos = int(free[1, ids.shape[1] + 2])  # fires in row 1 at step 3
        stopped = reference(model, ids, mask, use_cache=True, eos_token_id=eos)
        assert (stopped[1, ids.shape[1] + 3 :] == 0).all()  # row 1 padded after its EOS
        engine = InferenceEngine(copy.deepcopy(model), TP_PP)
        check_split(engine, family)
        for cache in (True, False):
            got = engine.generate(ids, mask, SamplingConfig(max_new_tokens=NEW, use_cache=cache))
            assert torch.equal(got, free), (family, cache, got, free)
            got = engine.generate(
                ids, mask, SamplingConfig(max_new_tokens=NEW, use_cache=cache, eos_token_id=eos)
            )
            assert torch.equal(got, stopped), (family, cache, "eos", got, stopped)
            checked += 2
    assert checked == 3 * 2 * 2
    # seeded sampling: the deciding rank's choice, on all four ranks, as on one process
    settings = {"max_new_tokens": NEW, "do_sample": True, "top_k": 40, "seed": 7}
    sampled = engine.generate(ids, mask, SamplingConfig(**settings))  # LLaMA, the last family
    alone = InferenceEngine(copy.deepcopy(model)).generate(ids, mask, SamplingConfig(**settings))
    assert torch.equal(sampled, alone) and not torch.equal(sampled, free)
    gathered = [torch.empty_like(sampled) for _ in range(4)]
    dist.all_gather(gathered, sampled)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@distributed(4)
def test_tp_pp_errors() -> None:
    with pytest.raises(ValueError, match="= 8 must divide the world size 4"):
        InferenceEngine(build("gpt2"), InferenceConfig(tp_size=2, pp_size=4))
    engine = InferenceEngine(build("opt"), TP_PP)
    ids, mask = prompts()
    with pytest.raises(ValueError, match="different input_ids"):
        engine.generate(ids + dist.get_rank() // 3, mask, SamplingConfig(max_new_tokens=2))
    assert engine.generate(ids, mask, SamplingConfig(max_new_tokens=2)).shape == (3, 9)
