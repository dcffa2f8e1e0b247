"""``InferenceEngine`` with ``pp_size=2`` on 2 CPU/gloo ranks against transformers' ``generate``.

One spawned job: GPT-2, OPT and LLaMA (2 layers, hidden 32; the models and the left-padded batch
of prompt lengths 4, 6 and 7 of ``test_inference_generate.py``), KV cache on and off, with and
without an EOS that fires mid-way in one row. Greedy output must equal ``generate`` on the whole
model token for token (``torch.equal``) on both stages; each stage holds one decoder block and a
one-layer cache. Seeded sampling gives the tokens of one process on both stages. Errors that
need a process group are checked too (serving on a pipeline: ``test_inference_batching_pp.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_inference_generate import FAMILIES, NEW, build, prompts, reference

from kolossos.inference import InferenceConfig, InferenceEngine, SamplingConfig
from kolossos.testing import distributed

pytestmark = pytest.mark.dist


def check_split(engine: InferenceEngine, family: str) -> None:
    """This stage keeps one of the two blocks, and its cache holds one layer."""
    blocks = [m for m in engine.model.modules() if type(m).__name__.endswith(("Block", "Layer"))]
    assert len(blocks) == 1, (family, [type(m).__name__ for m in blocks])
    stage = engine._stage
    assert stage is not None and stage.stage == dist.get_rank()
    cache = stage(torch.tensor([[1, 2, 3]]), use_cache=True)[engine.cache_keyword]
    assert len(cache.layers) == 1 and cache.layers[0].keys.shape[2] == 3
    torch.manual_seed(0)
    full = FAMILIES[family]()
    mine = dict(engine.model.named_parameters())
    other = sum(p.numel() for p in full.parameters()) - sum(p.numel() for p in mine.values())
    assert other > 0, "the stage kept every parameter"


@distributed(2)
def test_pipeline_greedy_equals_transformers_generate() -> None:
    ids, mask = prompts()
    checked = 0
    for family in FAMILIES:
        model = build(family)
        free = reference(model, ids, mask, use_cache=True)
        assert free.shape[1] == ids.shape[1] + NEW  # EOS 99 never fired
        eos = int(free[1, ids.shape[1] + 2])  # fires in row 1 at step 3
        stopped = reference(model, ids, mask, use_cache=True, eos_token_id=eos)
        assert (stopped[1, ids.shape[1] + 3 :] == 0).all()  # row 1 padded after its EOS
        engine = InferenceEngine(copy.deepcopy(model), InferenceConfig(pp_size=2))
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
    # seeded sampling: the last stage's choice, the same on both stages and as on one process
    settings = {"max_new_tokens": NEW, "do_sample": True, "top_k": 40, "seed": 7}
    sampled = engine.generate(ids, mask, SamplingConfig(**settings))  # LLaMA, the last family
    alone = InferenceEngine(copy.deepcopy(model)).generate(ids, mask, SamplingConfig(**settings))
    assert torch.equal(sampled, alone) and not torch.equal(sampled, free)
    gathered = [torch.empty_like(sampled) for _ in range(2)]
    dist.all_gather(gathered, sampled)
    assert torch.equal(gathered[0], gathered[1])


@distributed(2)
def test_pipeline_errors() -> None:
    with pytest.raises(ValueError, match="must divide the world size 2"):
        InferenceEngine(build("gpt2"), InferenceConfig(pp_size=3))
    with pytest.raises(ValueError, match="must divide the world size 2"):
        InferenceEngine(build("gpt2"), InferenceConfig(tp_size=2, pp_size=2))
    engine = InferenceEngine(build("llama"), InferenceConfig(pp_size=2))
    ids, mask = prompts()
    mine = ids + dist.get_rank()
    with pytest.raises(ValueError, match="different input_ids"):
        engine.generate(mine, mask, SamplingConfig(max_new_tokens=2))
