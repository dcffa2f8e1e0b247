"""Continuous and static batching (``kolossos.inference.batching`` / ``scheduler``) on one process,
and the LRU result cache.

Continuous batching must give every request exactly the greedy tokens it gets alone: requests of
different prompt lengths, lengths of output and EOS ids join at different steps and leave when
done, and each one's tokens are compared with transformers' ``generate`` of its prompt alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import transformers as tf
from torch import nn

from kolossos.inference import InferenceEngine, SamplingConfig, batching
from kolossos.inference.batching import (
    BatchingConfig,
    DecodingBatch,
    GenerationRequest,
    TokenEvent,
)
from kolossos.inference.cache import cache_keyword
from kolossos.inference.result_cache import ResultCache
from kolossos.inference.scheduler import Scheduler

QUIET = {"bos_token_id": 99, "eos_token_id": 99, "pad_token_id": 0}
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6], [9], [40, 41, 42, 43], [7, 7], [3, 30, 60, 90, 11]]
LENGTHS = [6, 3, 8, 5, 7, 4]
KEYWORD = (
    "cache" if "cache" in tf.GPT2LMHeadModel.forward.__code__.co_varnames else "past_key_values"
)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=100,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        initializer_range=0.5,
        **QUIET,
    )
    return tf.GPT2LMHeadModel(config).eval()


def alone(model: nn.Module, prompt: list[int], new: int, eos: int | None = None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new, do_sample=False, eos_token_id=eos if eos is not None else 99,
    )  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def request(i: int, eos: tuple[int, ...] = (99,), **sampling: object) -> GenerationRequest:
    config = SamplingConfig(max_new_tokens=LENGTHS[i], **sampling)  # type: ignore[arg-type]
    return GenerationRequest(
        request_id=f"r{i}", prompt_ids=tuple(PROMPTS[i]), sampling=config, eos_token_ids=eos
    )


def collect(batch: DecodingBatch, joins: dict[int, list[GenerationRequest]]) -> dict[str, list]:
    got: dict[str, list[TokenEvent]] = {}
    step = 0
    while step <= max(joins) or batch.running:
        batch.add(joins.get(step, []))
        for event in batch.step():
            got.setdefault(event.request_id, []).append(event)
        step += 1
    return got


@pytest.mark.parametrize("merge", [True, False], ids=["merged-cache", "re-prefill"])
def test_continuous_batching_equals_each_request_alone(
    merge: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not merge:  # the fallback for a cache of unknown layout: re-run the batch at a join
        monkeypatch.setattr(batching, "_mergeable", lambda cache: False)
    model = gpt2()
    if merge:  # the model's cache has the layout joins merge into
        assert batching._mergeable(model(torch.tensor([[1]]), use_cache=True)[cache_keyword(model)])
    # request 3 stops at its own EOS id (the first new token seen from its third on, in its
    # alone output), request 4 at the model's EOS 99, both before max_new_tokens
    free = alone(model, PROMPTS[3], LENGTHS[3])
    eos3 = next(t for j, t in enumerate(free) if j >= 2 and free.index(t) == j)
    batch = DecodingBatch(
        model, cache_keyword=cache_keyword(model), sync=lambda t: t, pad_token_id=0
    )
    joins = {
        0: [request(0), request(1)],
        2: [request(2)],
        3: [request(3, eos=(eos3, 99))],
        4: [request(4), request(5)],  # request 1 has left by now (3 tokens)
    }
    got = collect(batch, joins)
    assert len(got) == 6
    for i in range(6):
        events = got[f"r{i}"]
        expected = alone(model, PROMPTS[i], LENGTHS[i], eos3 if i == 3 else None)
        assert [e.token for e in events] == expected, i
        stopped = expected[-1] in (eos3, 99)
        assert events[-1].finish_reason == ("stop" if stopped else "length")
        assert all(e.finish_reason is None for e in events[:-1])
    assert len(got["r3"]) < LENGTHS[3] and len(got["r4"]) < LENGTHS[4]  # EOS fired mid-way


def test_static_batch_keeps_rows_until_all_done_and_cancel() -> None:
    model = gpt2()
    batch = DecodingBatch(
        model, cache_keyword=cache_keyword(model), sync=lambda t: t, pad_token_id=0,
        keep_finished=True,
    )  # fmt: skip
    batch.add([request(0), request(1), request(2)])
    batch.step()
    batch.cancel({"r2"})
    got: dict[str, list[int]] = {}
    while batch.running:
        for event in batch.step():
            got.setdefault(event.request_id, []).append(event.token)
    assert "r2" not in got
    assert [*got["r1"]] == alone(model, PROMPTS[1], LENGTHS[1])[1:]
    assert [*got["r0"]] == alone(model, PROMPTS[0], LENGTHS[0])[1:]


def run_scheduler(config: BatchingConfig, requests: list[GenerationRequest]) -> tuple:
    scheduler = Scheduler(InferenceEngine(gpt2()), config, idle_wait_s=0.01)
    got: dict[str, list[int]] = {}
    order: list[str] = []
    done = threading.Semaphore(0)

    def sink(event: TokenEvent | BaseException) -> None:
        assert isinstance(event, TokenEvent)
        got.setdefault(event.request_id, []).append(event.token)
        if event.finish_reason is not None:
            order.append(event.request_id)
            done.release()

    for r in requests:
        scheduler.submit(r, sink)
    thread = threading.Thread(target=scheduler.run)
    thread.start()
    for _ in requests:
        assert done.acquire(timeout=120)
    scheduler.stop()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return got, order, scheduler


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_scheduler_fifo_and_buckets(mode: str) -> None:
    model = gpt2()
    requests = [request(i) for i in range(6)]
    requests[3] = request(3, do_sample=True, temperature=0.7, seed=3)
    config = BatchingConfig(mode=mode, executor_max_batch_size=2, cache_size=0)  # type: ignore
    got, order, _ = run_scheduler(config, requests)
    for i in (0, 1, 2, 4, 5):
        assert got[f"r{i}"] == alone(model, PROMPTS[i], LENGTHS[i]), i
    assert len(got["r3"]) == LENGTHS[3]
    if mode == "static":
        # buckets: [r0, r1] (r1 asks fewer steps than r0), [r2] (r3 samples), [r3], [r4, r5]
        # (r4 meets EOS at its 4th token, the step r5 reaches its length 4)
        assert order == ["r1", "r0", "r2", "r3", "r4", "r5"]
    else:  # r2 joins as soon as r1 leaves, before r0 is done
        assert order.index("r2") > order.index("r1") and order[:2] == ["r1", "r0"]


def test_result_cache_answers_once_the_list_is_full() -> None:
    config = BatchingConfig(cache_size=4, cache_list_size=2)
    same = [request(0), request(0), request(0)]
    same = [GenerationRequest(**{**r.__dict__, "request_id": f"q{k}"}) for k, r in enumerate(same)]
    got, _, scheduler = run_scheduler(config, same[:2])
    assert got["q0"] == got["q1"]
    assert scheduler.cache.get(Scheduler._key(same[2])) is not None  # two results stored
    cache: ResultCache[int] = ResultCache(cache_size=2, cache_list_size=1)
    for key in ("a", "b", "c"):
        cache.add(key, 1)
    assert cache.get("a") is None and cache.get("c") == 1  # LRU: "a" evicted
    assert len(ResultCache(0, 1)) == 0
    with pytest.raises(ValueError, match="executor_max_batch_size"):
        BatchingConfig(executor_max_batch_size=0)
    with pytest.raises(ValueError, match="mode"):
        BatchingConfig(mode="dynamic")  # type: ignore[arg-type]


def test_scheduler_cancel_removes_the_row() -> None:
    scheduler = Scheduler(InferenceEngine(gpt2()), BatchingConfig(cache_size=0), idle_wait_s=0.01)
    events: list[TokenEvent] = []

    def sink(event: TokenEvent | BaseException) -> None:
        assert isinstance(event, TokenEvent)
        events.append(event)
        scheduler.cancel(event.request_id)  # a client that leaves after its first token

    long = GenerationRequest(
        request_id="long", prompt_ids=(1, 2), sampling=SamplingConfig(max_new_tokens=25)
    )
    scheduler.submit(long, sink)
    thread = threading.Thread(target=scheduler.run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while scheduler.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.pending() == 0
    finally:
        scheduler.stop()
        thread.join(timeout=120)
    assert len(events) == 1 and scheduler.steps <= 2  # not the 25 steps of the request
