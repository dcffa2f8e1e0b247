"""Continuous and static batching on a pipeline-parallel engine: pp 2 on 2 CPU/gloo ranks and
tp 2 x pp 2 on 4.

Requests of different prompt lengths, output lengths and EOS ids join a :class:`DecodingBatch`
at different steps (the merged KV cache on every stage) and leave when done; each must get
exactly the greedy tokens transformers' ``generate`` gives its prompt alone, on every rank. Then
the serving :class:`Scheduler` runs as ``kolossos serve`` runs it (the leader queues the requests
and broadcasts each step's plan; the other ranks follow) in both batching modes.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from torch import nn

from kolossos.inference import InferenceConfig, InferenceEngine, SamplingConfig
from kolossos.inference.batching import BatchingConfig, DecodingBatch, GenerationRequest, TokenEvent
from kolossos.inference.scheduler import Scheduler
from kolossos.testing import distributed

pytestmark = pytest.mark.dist

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6], [9], [40, 41, 42, 43], [7, 7], [3, 30, 60, 90, 11]]
LENGTHS = [6, 3, 8, 5, 7, 4]
JOINS = {0: [0, 1], 2: [2], 3: [3, 4], 4: [5]}  # step -> requests joining before it


QUIET = {"bos_token_id": 99, "eos_token_id": 99, "pad_token_id": 0, "initializer_range": 0.5}


def build(family: str) -> nn.Module:
    """2 layers, hidden 32, 4 heads (LLaMA: 2 KV heads); large initial weights, so greedy
    output varies from token to token."""
    torch.manual_seed(0)
    if family == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4, **QUIET)
        ).eval()
    if family == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=100, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32, **QUIET,
        )).eval()  # fmt: skip
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **QUIET,
    )).eval()  # fmt: skip


def alone(model: nn.Module, prompt: list[int], new: int, eos: int = 99) -> list[int]:
    """``generate``'s greedy tokens for one prompt, up to and including its EOS."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def requests(model: nn.Module) -> tuple[list[GenerationRequest], dict[str, list[int]]]:
    """Six greedy requests (one with an EOS that fires mid-way) and their tokens."""
    eos = [99] * len(PROMPTS)
    free = alone(model, PROMPTS[2], LENGTHS[2])
    eos[2] = next(t for k, t in enumerate(free) if k and t not in free[:k])  # a new token
    out = [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=tuple(p),
            sampling=SamplingConfig(max_new_tokens=LENGTHS[i]),
            eos_token_ids=(eos[i],),
        )
        for i, p in enumerate(PROMPTS)
    ]
    expected = {f"r{i}": alone(model, p, LENGTHS[i], eos[i]) for i, p in enumerate(PROMPTS)}
    assert 1 < len(expected["r2"]) < LENGTHS[2], expected["r2"]
    return out, expected


def scheduled(engine: InferenceEngine, mode: str, batch: list[GenerationRequest]) -> dict:
    """Run ``batch`` through a :class:`Scheduler` on every rank; the leader's tokens."""
    config = BatchingConfig(mode=mode, executor_max_batch_size=4, cache_size=0)  # type: ignore[arg-type]
    scheduler = Scheduler(engine, config, idle_wait_s=0.01)
    if not scheduler.is_leader:
        scheduler.run()  # until the leader's stop plan
        return {}
    got: dict[str, list[int]] = {}
    done = threading.Semaphore(0)

    def sink(event: TokenEvent | BaseException) -> None:
        assert isinstance(event, TokenEvent), event
        got.setdefault(event.request_id, []).append(event.token)
        if event.finish_reason is not None:
            done.release()

    thread = threading.Thread(target=scheduler.run)
    thread.start()
    for request in batch:
        scheduler.submit(request, sink)
    for _ in batch:
        assert done.acquire(timeout=300), "hang detector"
    scheduler.stop()
    thread.join(timeout=300)
    assert not thread.is_alive()
    return got


@pytest.mark.parametrize("world_size", [2, 4], ids=["pp2", "tp2xpp2"])
@distributed()
def test_batching_on_a_pipeline_equals_each_request_alone(world_size: int) -> None:
    config = InferenceConfig(tp_size=world_size // 2, pp_size=2)
    for family in ("gpt2", "opt", "llama"):
        model = build(family)
        batch, expected = requests(model)
        engine = InferenceEngine(copy.deepcopy(model), config)
        decoding = DecodingBatch(
            engine.decoder, cache_keyword=engine.cache_keyword, sync=engine.sync_tokens,
            pad_token_id=0,
        )  # fmt: skip
        got: dict[str, list[int]] = {}
        step = 0
        while step <= max(JOINS) or decoding.running:
            decoding.add([batch[i] for i in JOINS.get(step, [])])
            for event in decoding.step():
                got.setdefault(event.request_id, []).append(event.token)
            step += 1
        assert got == expected, (family, got, expected)
        everyone: list[object] = [None] * world_size
        dist.all_gather_object(everyone, got)
        assert all(g == got for g in everyone)
        if family == "llama":
            for mode in ("continuous", "static"):
                leader = scheduled(engine, mode, batch)
                assert dist.get_rank() != 0 or leader == expected, (mode, leader, expected)
