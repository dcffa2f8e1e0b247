"""``kolossos plan`` and its estimators: parameter counts against ``transformers``, the pieces
replayed from the engines against the engines' own code, the memory and communication logic,
the recommendation, and the command line (flags, output, every bad input giving exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kolossos.cli.main import main
from kolossos.cli.plan import parse_size
from kolossos.utils.profiling import (
    Layout,
    PlanRequest,
    Workload,
    candidate_layouts,
    count_parameters,
    estimate_memory,
    load_model_shape,
    make_plan,
    model_state_bytes,
    shape_from_config,
)
from kolossos.utils.profiling.activations import activation_bytes
from kolossos.utils.profiling.comm_estimate import comm_estimate
from kolossos.utils.profiling.dp_memory import zero_phases
from kolossos.utils.profiling.memory_phases import activation_points, working_bytes
from kolossos.utils.profiling.model_params import padded_vocab
from kolossos.utils.profiling.model_shape import KNOWN_MODELS
from kolossos.utils.profiling.plugin_memory import _BUILDERS
from kolossos.utils.profiling.rank_model import rank_models, stage_layer_counts
from kolossos.utils.profiling.sharded_memory import chunk_sizes, search_chunk_size
from kolossos.utils.profiling.zero_buckets import plan_bucket_ranges, zero_buffers

SMALL: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
             "n_positions": 32},
    "gpt2-untied": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2,
                    "vocab_size": 50, "n_inner": 48, "tie_word_embeddings": False},
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 100, "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 100, "head_dim": 32},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 100, "tie_word_embeddings": True},
    "opt": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 40,
            "word_embed_proj_dim": 32},
    "bert": {"model_type": "bert", "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
             "max_position_embeddings": 40},
    "vit": {"model_type": "vit", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32,
            "patch_size": 8, "num_labels": 10},
}  # fmt: skip
GIB = 2**30


# ----------------------------------------------------------------------------- model shapes
def _transformers_count(config: dict[str, Any]) -> int:
    transformers = pytest.importorskip("transformers")
    kind = config["model_type"]
    cfg = transformers.AutoConfig.for_model(
        kind, **{k: v for k, v in config.items() if k != "model_type"}
    )
    auto = {
        "bert": transformers.AutoModelForMaskedLM,
        "vit": transformers.AutoModelForImageClassification,
    }.get(kind, transformers.AutoModelForCausalLM)
    with torch.device("meta"):  # no memory: only the parameter shapes matter
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_parameter_count_matches_transformers(name: str) -> None:
    config = SMALL[name]
    assert count_parameters(shape_from_config(config)) == _transformers_count(config)


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2", "llama-3-8b", "mistral-7b", "qwen2-7b",
                                  "opt-1.3b", "bert-base", "vit-base"])  # fmt: skip
def test_named_models_count_like_transformers(name: str) -> None:
    """The defaults each family fills in for missing keys are transformers' own."""
    assert count_parameters(load_model_shape(name)) == _transformers_count(KNOWN_MODELS[name])


def test_config_files_and_folders_load(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL["llama"]))
    for spec in (str(path), str(tmp_path)):
        shape = load_model_shape(spec)
        assert (shape.family, shape.kv_heads, shape.head_dim, shape.tied_embeddings) == (
            "llama", 2, 16, False,
        )  # fmt: skip
    assert load_model_shape("gpt2-tiny").default_seq_len == 64
    assert load_model_shape("llama-3-8b").default_seq_len == 2048


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"model_type": "t5"}, "model_type='t5' is not supported"),
        ({"hidden_size": 8}, "model_type=None is not supported"),
        ({"model_type": "gpt2", "n_embd": 0}, "n_embd=0 must be an int >= 1"),
        ({"model_type": "gpt2", "n_embd": 10, "n_head": 3}, "not divisible by 3 heads"),
        ({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4},
         "not a multiple"),
        ({"model_type": "opt", "do_layer_norm_before": False}, "not modelled"),
        ({"model_type": "gpt2", "resid_pdrop": "x"}, "must be a probability in"),
        ([1, 2], "expected a JSON object"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_clearly(config: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shape_from_config(config)


# ----------------------------------------------------------------------------- replayed engine code
def test_chunk_search_and_packing_match_gemini() -> None:
    from kolossos.zero.gemini.chunk.manager import ChunkManager
    from kolossos.zero.gemini.chunk.search import search_chunk_size as gemini_search

    for numels in ([300, 700, 200, 900, 50] * 3, [5000, 10, 4000, 4000, 3000]):
        size = search_chunk_size(numels, 1500, 1000, 100)
        assert size == gemini_search(numels, 1500, 1000, 100)[0]
        params = [(f"p{i}", torch.nn.Parameter(torch.empty(n))) for i, n in enumerate(numels)]
        manager = ChunkManager(params, size, torch.float32, None, torch.device("cpu"))
        assert chunk_sizes(numels, 1, size) == [c.chunk_size for c in manager.chunks]
        for alone in (0, 2, len(numels) - 1):  # a tied tensor: alone in a chunk
            mask = [i == alone for i in range(len(numels))]
            size = search_chunk_size(numels, 1500, 1000, 100, alone=alone)
            assert size == gemini_search(numels, 1500, 1000, 100, alone=mask)[0]
            manager = ChunkManager(params, size, torch.float32, None, torch.device("cpu"),
                                   alone=[params[alone][1]])  # fmt: skip
            assert chunk_sizes(numels, 1, size, alone=alone) == [
                c.chunk_size for c in manager.chunks
            ]
    assert chunk_sizes([10, 20], 4) == [32]  # under min_chunk_size: one chunk, rounded to N


def test_bucket_ranges_match_lowlevel_zero() -> None:
    from kolossos.zero.low_level.bucket import plan_buckets
    from kolossos.zero.low_level.partition import FlatLayout

    shapes = [(6,), (4,), (9,), (1,)]
    for n, numel in ((2, 3), (4, 5), (3, 100)):
        ours = plan_bucket_ranges(20, n, numel)
        theirs = plan_buckets([FlatLayout.of_shapes(shapes, n)], numel)
        assert ours == [(b.start, b.stop, b.owner) for b in theirs]


def test_vocabulary_padding_and_stages_match_the_engines() -> None:
    from kolossos.nn.layer.parallel_1d._vocab import padded_vocab_size
    from kolossos.pipeline.partition import uniform_bounds

    for vocab, tp in ((50257, 2), (32000, 8), (100, 1)):
        expected = padded_vocab_size(vocab, tp, 64) if tp > 1 else vocab
        assert padded_vocab(vocab, tp) == expected
    for layers, pp in ((12, 5), (4, 2), (7, 7)):
        assert stage_layer_counts(layers, pp) == [e - s for s, e in uniform_bounds(layers, pp)]


def test_rank_models_split_the_model() -> None:
    shape = load_model_shape("gpt2-tiny")
    (whole,) = rank_models(shape)
    assert whole.numel == count_parameters(shape) and whole.tied_numel == 2048 * 128
    first, last = rank_models(shape, pp_size=2)
    assert last.tied_copy and last.numel - last.tied_numel + first.numel == whole.numel
    assert last.arrival[0] == len(last.sizes) - 1  # the tied copy's gradient comes first
    half = rank_models(shape, tp_size=2)[0]
    assert half.numel < whole.numel / 2 + 2 * 64 * 128 * 2  # biases and norms stay whole
    with pytest.raises(ValueError, match="cannot fill"):
        rank_models(shape, pp_size=3)


def test_zero_buffer_replay() -> None:
    # two ranks, one bucket per partition: each rank keeps its own part in its partition and
    # receives the other's part (or stages its own for the other); gloo's point-to-point
    # transfers are seen complete only when waited for, so the rank that sent the first bucket
    # still holds its buffer when it acquires the receive buffer of the second
    buf = zero_buffers([100, 100], [1, 0], 2, 1000, stage=2, pairwise=True, inside_after=1)
    assert buf.partition_inside and buf.inside == 100 and buf.after == 200
    # collectives are seen complete by the next gradient's arrival: one reused buffer
    assert zero_buffers([100, 100], [1, 0], 2, 1000, stage=2, pairwise=False).after == 100
    # a gradient spanning every bucket (GPT-2's tied embedding, first in the flat buffer and
    # last to arrive) holds every launch back: the buffers pile up at the end
    late = zero_buffers([400, 10, 10], [2, 1, 0], 2, 50, stage=2, pairwise=True, inside_after=2)
    assert late.inside < late.after
    # with collectives ZeRO-1 reduces in place: no buffers at all
    assert zero_buffers([100, 100], [1, 0], 4, 30, stage=1, pairwise=False).after == 0


# ----------------------------------------------------------------------------- memory logic
def _work(name: str = "gpt2-tiny", batch: int = 8, seq: int = 64, device: str = "cuda") -> Workload:
    return Workload(shape=load_model_shape(name), seq_len=seq, batch=batch, device=device)


def _step_states(layout: Layout, work: Workload, local: bool = False) -> float:
    """Model-state bytes at the step; ``local``: ZeRO-1 accumulated without communication
    (a pipeline step), so it holds its full gradient buffer."""
    (rank,) = rank_models(work.shape)
    if local:
        w = working_bytes(layout.precision)
        act = activation_bytes(work.shape, work.batch // layout.dp * work.seq_len, w)
        phases = zero_phases(rank=rank, n=layout.dp, w=w, stage=layout.zero_stage, offload=False,
                             act=act, at=activation_points(act, rank, False), work=work,
                             local=True)  # fmt: skip
    else:
        phases = _BUILDERS[layout.plugin](layout, work, rank)
    step = next(p for p in phases if p.name == "step")
    return sum(step.device.get(c, 0.0) for c in ("params", "grads", "optim"))


ZERO1_FP32 = Layout(plugin="zero", precision="fp32", dp=4, zero_stage=1)


@pytest.mark.parametrize(
    ("layout", "strategy", "precision", "local"),
    [
        (Layout(plugin="ddp", precision="fp32", dp=4), "ddp", "fp32", False),
        (Layout(plugin="zero", precision="bf16", dp=4, zero_stage=2), "zero2", "mixed", False),
        # ZeRO-1 keeps partitions, as ZeRO-2 does, unless it accumulated locally
        (ZERO1_FP32, "zero2", None, False),
        (ZERO1_FP32, "zero1", None, True),
        (Layout(plugin="fsdp", precision="bf16", dp=4, zero_stage=3), "zero3", "fp32", False),
    ],
)
def test_model_states_at_the_step_follow_the_zero_formulas(
    layout: Layout, strategy: str, precision: str | None, local: bool
) -> None:
    work = _work(batch=4)
    psi = count_parameters(work.shape)
    if precision is None:  # fp32 ZeRO: the master is the working weight, K = 8
        from kolossos.utils.profiling import PrecisionBytes

        expected = model_state_bytes(psi, strategy, 4, PrecisionBytes(param=4, grad=4, optim=8))
    else:
        expected = model_state_bytes(psi, strategy, 4, precision)
    assert _step_states(layout, work, local) == pytest.approx(expected.total, rel=1e-4)


def test_activation_terms() -> None:
    shape, tokens = load_model_shape("gpt2-tiny"), 64
    h, inner, a = 128, 512, 4
    fp32 = activation_bytes(shape, tokens, 4)
    assert fp32.layer == tokens * 4 * (8 * h + 5 * inner + a + 4)
    assert fp32.layer_checkpointed == tokens * 4 * h
    assert activation_bytes(shape, tokens, 2).layer < fp32.layer  # only the logsumexp stays fp32
    tp, sp = activation_bytes(shape, tokens, 4, 2), activation_bytes(shape, tokens, 4, 2, True)
    assert sp.layer < tp.layer < fp32.layer
    # causal-LM loss: fp32 log_softmax kept, two fp32 logits-sized gradients at the start
    assert fp32.loss_transient == tokens * 8 * 2048 and fp32.logits == tokens * 4 * 2048


def test_memory_orders_between_plugins() -> None:
    work = _work("gpt2-large", batch=16, seq=512)
    peaks = {
        name: estimate_memory(layout, work).peak
        for name, layout in {
            "ddp": Layout(plugin="ddp", precision="fp32", dp=8),
            "zero1": Layout(plugin="zero", precision="fp32", dp=8, zero_stage=1),
            "zero2": Layout(plugin="zero", precision="fp32", dp=8, zero_stage=2),
            "gemini": Layout(plugin="gemini", precision="fp32", dp=8, zero_stage=3),
            "ckpt": Layout(plugin="gemini", precision="fp32", dp=8, zero_stage=3,
                           checkpointing=True),
            "offload": Layout(plugin="zero", precision="fp32", dp=8, zero_stage=2, offload=True),
        }.items()
    }  # fmt: skip
    assert peaks["ddp"] > peaks["zero2"] > peaks["gemini"] > peaks["ckpt"]
    assert peaks["zero1"] == peaks["zero2"]  # ZeRO-1 keeps partitions when it does not accumulate
    assert peaks["offload"] < peaks["zero2"]
    assert estimate_memory(Layout(plugin="ddp", precision="fp32", dp=8), work).peak_phase == "loss"
    offloaded = estimate_memory(
        Layout(plugin="zero", precision="fp32", dp=8, zero_stage=2, offload=True), work
    )
    assert offloaded.host > 0 and offloaded.optim == 0


def test_pipeline_keeps_more_micro_batches_on_the_first_stage() -> None:
    work = _work("gpt2-50m", batch=16, seq=128)
    one = estimate_memory(Layout(plugin="hybrid", precision="bf16", dp=1, pp=2, microbatches=2),
                          work)  # fmt: skip
    four = estimate_memory(Layout(plugin="hybrid", precision="bf16", dp=1, pp=4, microbatches=8),
                           work)  # fmt: skip
    assert four.params < one.params  # fewer blocks per stage


def test_communication_estimates() -> None:
    work = _work("gpt2-tiny")
    psi = count_parameters(work.shape)
    ddp = comm_estimate(Layout(plugin="ddp", precision="fp32", dp=4), work)
    assert ddp.data_parallel == pytest.approx(2 * 4 * psi * 3 / 4)
    zero = comm_estimate(Layout(plugin="zero", precision="bf16", dp=4, zero_stage=2), work)
    assert zero.data_parallel == pytest.approx(2 * 2 * psi * 3 / 4)
    tp = comm_estimate(Layout(plugin="hybrid", precision="bf16", dp=1, tp=2), work)
    assert tp.tensor_parallel > 0 and tp.data_parallel == 0
    pp = comm_estimate(Layout(plugin="hybrid", precision="bf16", dp=1, pp=2, microbatches=4),
                       work)  # fmt: skip
    assert pp.pipeline == 4 * (8 // 4) * 64 * 128 * 2


# ----------------------------------------------------------------------------- layouts
def test_candidate_layouts_are_valid_plugin_calls() -> None:
    from kolossos.booster import plugin as plugins

    shape = load_model_shape("gpt2-tiny")
    layouts = candidate_layouts(shape, nproc=4, nnodes=2, batch=16, precision="bf16")
    checks = {name: getattr(plugins, name).check_arguments for name in plugins.__all__
              if name.endswith("Plugin")}  # fmt: skip
    for layout in layouts:
        assert layout.world_size == 8 and shape.heads % layout.tp == 0 and layout.tp <= 4
        eval(layout.plugin_call(), {"__builtins__": {}}, checks)  # every printed call is valid
    names = {lay.name for lay in layouts}
    assert {"ddp", "zero stage2 offload", "gemini auto", "fsdp shard-grad-op ckpt",
            "hybrid tp2 pp2 dp2 zero1", "hybrid tp4 pp1 dp2 sp"} <= names  # fmt: skip
    assert Layout(plugin="ddp", precision="bf16", dp=2).booster_call() == (
        'Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")'
    )


def test_recommendation_order() -> None:
    shape = load_model_shape("gpt2-50m")
    roomy = make_plan(PlanRequest(shape=shape, nproc=4, budget=64 * GIB, seq_len=128, batch=8,
                                  precision="fp32"))  # fmt: skip
    assert roomy.recommended is not None and roomy.recommended.layout.plugin == "ddp"
    assert "least communication" in roomy.reason()
    zero2 = Layout(plugin="zero", precision="fp32", dp=4, zero_stage=2)
    tight_budget = int(estimate_memory(zero2, roomy.request.workload()).peak)
    tight = make_plan(PlanRequest(shape=shape, nproc=4, budget=tight_budget, seq_len=128,
                                  batch=8, precision="fp32"))  # fmt: skip
    best = tight.recommended
    assert best is not None and not best.layout.checkpointing and best.memory.peak <= tight_budget
    assert all(e.fits for e in tight.fitting) and not tight.estimates[-1].fits
    nothing = make_plan(PlanRequest(shape=shape, nproc=4, budget=2**20, seq_len=128, batch=8))
    assert nothing.recommended is None and nothing.reason() == "no layout fits"


# ----------------------------------------------------------------------------- command line
def test_parse_size_units() -> None:
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("24GiB") == parse_size("24G") == parse_size("24 gib") == 24 * 2**30
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5T") == int(1.5 * 2**40)
    assert parse_size("4096") == 4096
    for bad in ("24XB", "-1GB", "GB", "", "0.1"):
        with pytest.raises(ValueError, match="--mem-per-rank"):
            parse_size(bad)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_table_and_call(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "gpt2-tiny", "--nproc", "2", "--mem-per-rank", "1GiB", "--batch", "8"]
    code, out, err = _run([*argv, "--precision", "fp32"], capsys)
    assert code == 0 and not err
    assert "Recommended: ddp" in out and "booster = Booster(plugin=TorchDDPPlugin())" in out
    assert "from kolossos.booster.plugin import TorchDDPPlugin" in out
    code, out, _ = _run([*argv, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["recommended"]["fits"] and data["world_size"] == 2
    assert data["model"]["parameters"] == 667136 and data["seq_len"] == 64
    assert len(data["layouts"]) > 20 and data["reason"].endswith(".")


def test_plan_restricts_hybrid_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--model", "gpt2-tiny", "--nproc", "4", "--mem-per-rank", "8GiB",
                         "--tp", "2", "--pp", "2", "--json"], capsys)  # fmt: skip
    hybrids = [lay for lay in json.loads(out)["layouts"] if lay["plugin"] == "hybrid"]
    assert code == 0 and hybrids and all(h["tp"] == 2 and h["pp"] == 2 for h in hybrids)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--model", "/nowhere/config.json"], "cannot read"),
        (["--model", "{bad}"], "invalid-json"),
        (["--model", "{t5}"], "model_type='t5' is not supported"),
        (["--mem-per-rank", "24XB"], "is not a size"),
        (["--mem-per-rank=-4GB"], "is not a size"),
        (["--mem-per-rank", "-4GB"], "write --option=VALUE"),
        (["--mem-per-rank", "1KiB"], "no layout fits in 0.00 MiB per rank: the smallest"),
        (["--nproc", "0"], "nproc=0 must be a positive integer"),
        (["--nnodes", "-1"], "nnodes=-1 must be a positive integer"),
        (["--seq-len", "0"], "seq_len=0 must be a positive integer"),
        (["--seq-len", "100"], "exceeds the model's 64 positions"),
        (["--batch", "0"], "batch=0 must be a positive integer"),
        (["--batch", "2", "--nnodes", "3"], "pass --batch as a multiple of 6"),
        (["--tp", "3", "--nproc", "4"], "--tp 3 does not divide 4"),
        (["--pp", "3", "--nproc", "4"], "--pp 3 does not divide 4"),
        (["--nproc", "four"], "invalid int value: 'four'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--mem-per-rnk", "8GB"], "did you mean --mem-per-rank?"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {"{bad}": "{not json", "{t5}": json.dumps({"model_type": "t5"})}
    argv = list(argv)
    for i, value in enumerate(argv):
        if value in files:
            path = tmp_path / "config.json"
            path.write_text(files[value])
            argv[i] = str(path)
    defaults = {"--model": "gpt2-tiny", "--nproc": "2", "--mem-per-rank": "8GiB"}
    for flag, value in defaults.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            argv += [flag, value]
    code, out, err = _run(argv, capsys)
    if message == "invalid-json":
        message = "is not valid JSON"
    assert code == 2 and not out, (out, err)
    assert message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_plan_is_a_registered_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert main(["plan", "--help"]) == 0
    assert "--mem-per-rank" in capsys.readouterr().out
