"""``kolossos plan`` against real runs on 2 CPU ranks: the estimated per-rank peak of tiny
``transformers`` models within 10% of the peak a ``TensorMemoryTracker`` measures (the cases of
``benchmarks/plan_accuracy.py``, shrunk), and the plugin call the planner recommends trains.

Memory is counted exactly (every tensor storage), so the figures are deterministic: the test
asserts the 10% the command promises; the benchmark's table shows the actual errors.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from benchmarks.plan_accuracy import (
    Case,
    build_model,
    estimate_case,
    gpt2_config,
    layout_of,
    llama_config,
    run_rank,
)
from kolossos.cli.main import main
from kolossos.testing import distributed

pytest.importorskip("transformers")  # imported here, once, before the ranks are forked

GPT2 = gpt2_config(2, 64, 4, 512, 32)
LLAMA = llama_config("llama", 2, 64, 4, 2, 160, 512, 32)
CASES = [
    Case("gpt2-ddp-fp32", GPT2, layout_of("ddp", "fp32"), 32, 8),
    Case("llama-zero2-bf16", LLAMA, layout_of("zero", "bf16", zero_stage=2), 32, 8),
    Case("gpt2-gemini-bf16-ckpt", GPT2,
         layout_of("gemini", "bf16", zero_stage=3, checkpointing=True), 32, 8),
    Case("llama-tp2-fp32", LLAMA, layout_of("hybrid", "fp32", dp=1, tp=2), 32, 8),
]  # fmt: skip


@distributed(2)
def test_estimates_within_ten_percent_of_measured_peaks() -> None:
    errors = {}
    for case in CASES:
        peak = run_rank(case, steps=2)["peak"]
        measured = max(r for r in _gather(peak))
        estimate, _ = estimate_case(case)
        errors[case.label] = (estimate - measured) / measured
    assert all(abs(e) <= 0.10 for e in errors.values()), errors


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _recommended(capsys: pytest.CaptureFixture[str], budget: str) -> dict[str, Any]:
    argv = ["plan", "--model", "gpt2-tiny", "--nproc", "2", "--mem-per-rank", budget,
            "--seq-len", "32", "--batch", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    recommended: dict[str, Any] = plan["recommended"]
    return {**recommended, "layouts": plan["layouts"]}


def test_recommended_calls_train(capsys: pytest.CaptureFixture[str]) -> None:
    """The recommendation with room to spare, and with a budget just under that layout's peak
    (another layout has to be chosen), each trained for three steps on 2 ranks."""
    roomy = _recommended(capsys, "4GiB")
    below = int(roomy["memory"]["peak"]) - 1
    tight = _recommended(capsys, str(below))
    assert tight["booster"] != roomy["booster"] and tight["memory"]["peak"] <= below
    for choice in (roomy, tight):
        _train_with(choice["booster"], choice["pp"] > 1, choice["activation_checkpointing"])


@distributed(2)
def _train_with(booster_call: str, pipeline: bool, checkpointing: bool) -> None:
    from kolossos.booster import Booster
    from kolossos.booster import plugin as plugins
    from kolossos.utils.profiling.layouts import CHECKPOINTING_CALL
    from kolossos.utils.profiling.model_shape import KNOWN_MODELS

    torch.manual_seed(0)
    model = build_model(KNOWN_MODELS["gpt2-tiny"])
    if checkpointing:
        eval(CHECKPOINTING_CALL, {"__builtins__": {}}, {"model": model})
    names = {name: getattr(plugins, name) for name in plugins.__all__}
    booster = eval(booster_call, {"__builtins__": {}}, {**names, "Booster": Booster})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    boosted, opt, *_ = booster.boost(model, optimizer)
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(3):
        if pipeline:
            out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), boosted,
                                           lambda o, _: o.loss, opt)  # fmt: skip
            loss = out["loss"]
        else:
            loss = boosted(input_ids=ids, labels=ids, use_cache=False).loss
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
