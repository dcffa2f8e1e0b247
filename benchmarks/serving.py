"""Serving throughput and latency: continuous batching vs static batching vs transformers'
``generate`` one request at a time, on one fixed request mix, in one run.

The mix (seeded): ``--requests`` prompts of 8-48 random tokens asking for 8-64 new tokens each,
all submitted at time 0 (a burst, FIFO order), greedy, the EOS disabled so every request gets its
full length. A request's latency runs from the burst to its last token; throughput is all
generated tokens over the wall time of the whole mix. The batching arms drive
:class:`kolossos.inference.scheduler.Scheduler` in-process (no HTTP) with the result cache off;
the baseline calls ``model.generate`` for each request in turn (batch of one, KV cache on). Each
arm's greedy tokens are checked against the baseline's.

Run from the repository root::

    python -m benchmarks.serving            # --requests 48 --max-batch 8 --hidden 128 --layers 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass

import torch
import transformers as tf

from kolossos.inference import InferenceEngine, SamplingConfig
from kolossos.inference.batching import BatchingConfig, GenerationRequest, TokenEvent
from kolossos.inference.scheduler import Scheduler


@dataclass(frozen=True)
class Result:
    """One arm's figures."""

    name: str
    tokens: int
    wall_s: float
    latencies: list[float]
    outputs: dict[int, list[int]]

    def row(self, baseline: dict[int, list[int]]) -> str:
        lat = sorted(self.latencies)
        p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
        same = sum(self.outputs[i] == baseline[i] for i in baseline)
        return (
            f"| {self.name} | {self.tokens / self.wall_s:,.0f} | {statistics.median(lat):.2f} | "
            f"{p99:.2f} | {self.wall_s:.2f} | {same}/{len(baseline)} |"
        )


def build_model(hidden: int, layers: int, vocab: int, context: int) -> tf.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=vocab, n_positions=context, n_embd=hidden, n_layer=layers,
        n_head=max(1, hidden // 32), initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(config).eval()


def request_mix(count: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(8, 48))], rng.randint(8, 64))
        for _ in range(count)
    ]


def run_generate(model: tf.GPT2LMHeadModel, mix: list[tuple[list[int], int]]) -> Result:
    outputs: dict[int, list[int]] = {}
    latencies = []
    start = time.perf_counter()
    with torch.no_grad():
        for i, (prompt, new) in enumerate(mix):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
            outputs[i] = out[0, len(prompt) :].tolist()
            latencies.append(time.perf_counter() - start)
    wall = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs.values())
    return Result(
        "transformers `generate`, one request at a time", tokens, wall, latencies, outputs
    )


def run_scheduler(
    model: tf.GPT2LMHeadModel, mix: list[tuple[list[int], int]], mode: str, max_batch: int
) -> Result:
    config = BatchingConfig(mode=mode, executor_max_batch_size=max_batch, cache_size=0)  # type: ignore[arg-type]
    scheduler = Scheduler(InferenceEngine(model), config, idle_wait_s=0.01)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(mix))}
    finished: dict[int, float] = {}
    all_done = threading.Event()
    lock = threading.Lock()

    def sink(event: TokenEvent | BaseException) -> None:
        assert isinstance(event, TokenEvent), event
        index = int(event.request_id)
        outputs[index].append(event.token)
        if event.finish_reason is not None:
            with lock:
                finished[index] = time.perf_counter()
                if len(finished) == len(mix):
                    all_done.set()

    thread = threading.Thread(target=scheduler.run)
    start = time.perf_counter()
    for i, (prompt, new) in enumerate(mix):
        sampling = SamplingConfig(max_new_tokens=new)
        scheduler.submit(GenerationRequest(request_id=str(i), prompt_ids=tuple(prompt),
                                           sampling=sampling), sink)  # fmt: skip
    thread.start()
    if not all_done.wait(timeout=1800):
        raise RuntimeError(f"{mode} batching did not finish the mix")
    wall = max(finished.values()) - start
    scheduler.stop()
    thread.join()
    latencies = [finished[i] - start for i in range(len(mix))]
    tokens = sum(len(o) for o in outputs.values())
    name = f"kolossos {mode} batching (executor_max_batch_size={max_batch})"
    return Result(name, tokens, wall, latencies, outputs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = build_model(args.hidden, args.layers, args.vocab, context=128)
    mix = request_mix(args.requests, args.vocab)
    new_tokens = sum(n for _, n in mix)
    print(
        f"mix: {len(mix)} requests, prompts 8-48 tokens, {new_tokens} new tokens in all; GPT-2 "
        f"hidden {args.hidden}, {args.layers} layers; torch threads 1"
    )
    baseline = run_generate(model, mix)
    results = [
        run_scheduler(model, mix, "continuous", args.max_batch),
        run_scheduler(model, mix, "static", args.max_batch),
        baseline,
    ]
    print("| arm | tokens/s | p50 latency (s) | p99 latency (s) | wall (s) | greedy = generate |")
    print("|---|---|---|---|---|---|")
    for result in results:
        print(result.row(baseline.outputs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
