"""How close ``kolossos plan``'s memory estimate comes to the measured peak, per configuration.

Each case trains a real ``transformers`` model built from a config (GPT-2, LLaMA, OPT, BERT,
Qwen2) with the plugin call the planner prints for a layout, on CPU ranks over gloo (2; 4 for the
tensor x data parallel case), for a few steps. Every tensor byte of each rank is counted by a
:class:`~kolossos.accelerator.TensorMemoryTracker` entered before the model is built; the peak
is read from the end of ``boost`` (so it is the training peak, what a device would hold) to the
end of the last step. The estimate is the planner's for the CPU (``Workload(device="cpu")``:
per-tensor AdamW, gloo's pairwise exchanges) and adds host and device bytes, which are one
memory here. The table lists estimate, measured peak (the largest over the ranks), and the error.

Usage::

    python -m benchmarks.plan_accuracy                 # every case (~1.5 min on 2 cores)
    python -m benchmarks.plan_accuracy --case gpt2-ddp --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kolossos.utils.profiling.layouts import CHECKPOINTING_CALL, Layout
from kolossos.utils.profiling.memory_phases import Workload
from kolossos.utils.profiling.model_shape import KNOWN_MODELS, shape_from_config
from kolossos.utils.profiling.plugin_memory import estimate_memory

__all__ = [
    "CASES",
    "Case",
    "bert_config",
    "build_model",
    "estimate_case",
    "gpt2_config",
    "layout_of",
    "llama_config",
    "measure_case",
    "opt_config",
    "run_rank",
]


def gpt2_config(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> dict[str, Any]:
    """A GPT-2 config dict without dropout."""
    return {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads,
            "vocab_size": vocab, "n_positions": seq, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0}  # fmt: skip


def llama_config(
    kind: str, layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int, seq: int
) -> dict[str, Any]:
    """A LLaMA-family (``kind``: llama, mistral, qwen2) config dict."""
    return {"model_type": kind, "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": inter, "vocab_size": vocab,
            "max_position_embeddings": seq}  # fmt: skip


def opt_config(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> dict[str, Any]:
    """An OPT config dict without dropout, MLP 4h."""
    return {"model_type": "opt", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "ffn_dim": 4 * hidden, "vocab_size": vocab,
            "max_position_embeddings": seq, "word_embed_proj_dim": hidden,
            "dropout": 0.0}  # fmt: skip


def bert_config(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> dict[str, Any]:
    """A BERT config dict without dropout, MLP 4h."""
    return {"model_type": "bert", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": heads, "intermediate_size": 4 * hidden, "vocab_size": vocab,
            "max_position_embeddings": seq, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One measured configuration: a model config, a layout, the sequence and global batch."""

    label: str
    config: dict[str, Any] = field(hash=False)
    layout: Layout
    seq_len: int
    batch: int

    def workload(self) -> Workload:
        """The planner's workload of this case, on the CPU."""
        shape = shape_from_config(self.config, self.label)
        return Workload(shape=shape, seq_len=self.seq_len, batch=self.batch, device="cpu")


def layout_of(plugin: str, precision: str, **kw: Any) -> Layout:
    """A :class:`Layout` over 2 data-parallel ranks unless ``dp`` says otherwise."""
    return Layout(plugin=plugin, precision=precision, dp=kw.pop("dp", 2), **kw)


GPT2_S = gpt2_config(4, 256, 4, 8192, 128)
LLAMA_S = llama_config("llama", 4, 256, 8, 4, 688, 8192, 128)
#: the measured configurations (2 ranks each; 4 for llama-tp2-dp2-zero1)
CASES: list[Case] = [
    Case("gpt2-ddp-fp32", GPT2_S, layout_of("ddp", "fp32"), 128, 8),
    Case("gpt2-ddp-fp32-ckpt", GPT2_S, layout_of("ddp", "fp32", checkpointing=True), 128, 16),
    Case("gpt2-zero1-bf16", GPT2_S, layout_of("zero", "bf16", zero_stage=1), 128, 8),
    Case("llama-zero2-bf16", LLAMA_S, layout_of("zero", "bf16", zero_stage=2), 128, 8),
    Case("opt-zero2-fp32-offload", opt_config(4, 256, 4, 8192, 128),
         layout_of("zero", "fp32", zero_stage=2, offload=True), 128, 8),
    Case("gpt2-gemini-bf16", GPT2_S, layout_of("gemini", "bf16", zero_stage=3), 128, 8),
    Case("bert-gemini-fp32", bert_config(4, 256, 4, 8192, 128),
         layout_of("gemini", "fp32", zero_stage=3), 128, 8),
    Case("llama-fsdp-bf16", LLAMA_S, layout_of("fsdp", "bf16", zero_stage=3), 128, 8),
    Case("gpt2-fsdp-fp32", GPT2_S, layout_of("fsdp", "fp32", zero_stage=3), 128, 8),
    Case("gpt2-tp2-bf16", GPT2_S, layout_of("hybrid", "bf16", dp=1, tp=2), 128, 8),
    Case("llama-tp2-sp-fp32", LLAMA_S, layout_of("hybrid", "fp32", dp=1, tp=2, sp=True), 128, 8),
    Case("gpt2-pp2-bf16", GPT2_S, layout_of("hybrid", "bf16", dp=1, pp=2, microbatches=4), 128, 8),
    Case("qwen2-zero1-fp32", llama_config("qwen2", 4, 256, 8, 2, 688, 8192, 128),
         layout_of("zero", "fp32", zero_stage=1), 128, 8),
    # other moments at the peak: small batches, small vocabularies, checkpointing
    Case("gpt2-wide-ddp", gpt2_config(4, 512, 8, 8192, 64), layout_of("ddp", "fp32"), 64, 2),
    Case("gpt2-wide-zero2", gpt2_config(4, 512, 8, 8192, 64),
         layout_of("zero", "fp32", zero_stage=2), 64, 2),
    Case("llama-deep-ddp", llama_config("llama", 6, 256, 4, 4, 1024, 512, 256),
         layout_of("ddp", "fp32"), 256, 8),
    Case("llama-deep-zero2-ckpt", llama_config("llama", 6, 256, 4, 4, 1024, 512, 256),
         layout_of("zero", "bf16", zero_stage=2, checkpointing=True), 256, 8),
    Case("gpt2-gemini-ckpt", GPT2_S, layout_of("gemini", "bf16", zero_stage=3, checkpointing=True),
         128, 8),
    Case("gpt2-gemini-offload", GPT2_S, layout_of("gemini", "fp32", zero_stage=3, offload=True),
         128, 8),
    Case("llama-gemini-bf16", LLAMA_S, layout_of("gemini", "bf16", zero_stage=3), 128, 8),
    Case("llama-bigvocab-gemini", llama_config("llama", 4, 256, 8, 4, 688, 32768, 128),
         layout_of("gemini", "bf16", zero_stage=3), 64, 4),
    Case("llama-gemini-replicated", LLAMA_S,
         layout_of("gemini", "bf16", zero_stage=3, shard_params=False), 128, 8),
    Case("gpt2-fsdp-shardgradop", GPT2_S, layout_of("fsdp", "bf16", zero_stage=3, reshard=False),
         128, 8),
    Case("bert-ddp-fp32", bert_config(4, 256, 4, 8192, 128), layout_of("ddp", "fp32"), 128, 8),
    Case("opt-pp2-fp32", opt_config(4, 256, 4, 8192, 128),
         layout_of("hybrid", "fp32", dp=1, pp=2, microbatches=4), 128, 8),
    Case("llama-tp2-sp-ckpt", LLAMA_S,
         layout_of("hybrid", "bf16", dp=1, tp=2, sp=True, checkpointing=True), 128, 16),
    Case("llama-tp2-dp2-zero1", LLAMA_S,
         layout_of("hybrid", "bf16", dp=2, tp=2, zero_stage=1), 128, 8),
    # the named benchmark models: several gradient buckets per partition, several chunks
    Case("gpt2-30m-zero2-fp32", KNOWN_MODELS["gpt2-30m"],
         layout_of("zero", "fp32", zero_stage=2), 128, 4),
    Case("gpt2-50m-gemini-bf16", KNOWN_MODELS["gpt2-50m"],
         layout_of("gemini", "bf16", zero_stage=3), 128, 4),
]  # fmt: skip


# ----------------------------------------------------------------------------- one rank
def build_model(config: dict[str, Any]) -> Any:
    """The ``transformers`` task model the planner assumes for ``config`` (seeded by the
    caller): ``*ForCausalLM``, ``BertForMaskedLM`` or ``ViTForImageClassification``."""
    import transformers

    kind = config["model_type"]
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    if kind != "vit":
        kwargs.setdefault("bos_token_id", 0)
        kwargs.setdefault("eos_token_id", 0)
        kwargs.setdefault("pad_token_id", 0)
    cfg = transformers.AutoConfig.for_model(kind, **kwargs)
    if kind == "bert":
        return transformers.AutoModelForMaskedLM.from_config(cfg)
    if kind == "vit":
        return transformers.AutoModelForImageClassification.from_config(cfg)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _plugin(layout: Layout) -> Any:
    """The plugin, built by evaluating the exact call the planner prints."""
    from kolossos.booster import plugin as plugins

    names = {name: getattr(plugins, name) for name in plugins.__all__}
    return eval(layout.plugin_call(), {"__builtins__": {}}, names)  # our own generated call


def _train(booster: Any, model: Any, opt: Any, layout: Layout, ids: Any, kind: str) -> None:
    if layout.pp > 1:
        batch = {"input_ids": ids, "labels": ids}
        booster.execute_pipeline(iter([batch]), model, lambda out, _: out.loss, opt)
    else:
        kwargs = {} if kind == "bert" else {"use_cache": False}
        out = model(input_ids=ids, labels=ids, **kwargs)
        booster.backward(out.loss, opt)
        del out  # the loop drops the step's outputs before the next forward
    opt.step()
    opt.zero_grad()


def run_rank(case: Case, steps: int) -> dict[str, Any]:
    """Build, boost and train ``case`` on this rank (process group up); the measured peak."""
    import torch
    import torch.distributed as dist

    from kolossos.accelerator import TensorMemoryTracker
    from kolossos.booster import Booster

    layout, kind = case.layout, case.config["model_type"]
    torch.manual_seed(0)
    rank = dist.get_rank()
    local = case.batch // layout.dp
    vocab = int(case.config.get("vocab_size", 8))
    with TensorMemoryTracker("cpu") as tracker:
        model = build_model(case.config)
        if layout.checkpointing:
            eval(CHECKPOINTING_CALL, {"__builtins__": {}}, {"model": model})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        booster = Booster(plugin=_plugin(layout), **_mixed(layout))
        boosted, opt, *_ = booster.boost(model, optimizer)
        del model, optimizer
        tracker.reset_peak()
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            ids = torch.randint(0, vocab, (local, case.seq_len), generator=gen)
            _train(booster, boosted, opt, layout, ids, kind)
        peak = int(tracker.peak_bytes)
        del boosted, opt, booster
    return {"rank": rank, "peak": peak}


def _mixed(layout: Layout) -> dict[str, Any]:
    return {"mixed_precision": layout.precision} if layout.plugin == "ddp" else {}


def _rank_entry(rank: int, world_size: int, port: int, case: Case, steps: int) -> dict[str, Any]:
    import kolossos

    kolossos.launch({}, rank, world_size, "127.0.0.1", port, backend="gloo", verbose=False)
    return run_rank(case, steps)


def measure_case(case: Case, steps: int = 3, timeout: float = 600.0) -> int:
    """The largest per-rank training peak of ``case`` over its ranks (bytes)."""
    from kolossos.testing import spawn

    results = spawn(_rank_entry, case.layout.world_size, timeout=timeout, case=case, steps=steps)
    return max(r["peak"] for r in results)


def estimate_case(case: Case) -> tuple[float, str]:
    """The planner's per-rank estimate for ``case`` (device plus host bytes, CPU paths) and the
    moment of the step it peaks at."""
    estimate = estimate_memory(case.layout, case.workload())
    return estimate.peak_total, estimate.peak_phase


# ----------------------------------------------------------------------------- driver
def _prepare_parent() -> None:
    """Import the heavy modules once, single-threaded, before forking ranks."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    import torch.distributed.fsdp

    import kolossos.booster.plugin  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Measure the cases, print the table and one JSON line; exit 1 if any error is over 10%."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_accuracy",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--case", action="append", help="run only these labels (repeatable)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per case (3)")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.case or c.label in args.case]
    if not cases:
        parser.error(f"no case named {args.case}; known: {[c.label for c in CASES]}")
    _prepare_parent()
    rows: list[dict[str, Any]] = []
    print(f"{'case':<24} {'layout':<26} {'peak at':<12} {'estimate MiB':>12} "
          f"{'measured MiB':>12} {'error':>7}")  # fmt: skip
    for case in cases:
        start = time.perf_counter()
        measured = measure_case(case, args.steps)
        estimate, phase = estimate_case(case)
        error = (estimate - measured) / measured
        rows.append({"case": case.label, "layout": case.layout.name,
                     "call": case.layout.plugin_call(), "seq_len": case.seq_len,
                     "batch": case.batch, "peak_phase": phase, "estimate": estimate,
                     "measured": measured,
                     "error": error, "seconds": time.perf_counter() - start})  # fmt: skip
        print(f"{case.label:<24} {case.layout.name:<26} {phase:<12} {estimate / 2**20:>12.2f} "
              f"{measured / 2**20:>12.2f} {100 * error:>+6.1f}%", flush=True)  # fmt: skip
    worst = max(abs(float(r["error"])) for r in rows)
    print(json.dumps({"benchmark": "plan_accuracy", "steps": args.steps, "worst_error": worst,
                      "rows": rows}))  # fmt: skip
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
