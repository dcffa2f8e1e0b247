"""Instruction fine-tuning of a local tiny LLaMA (sharded safetensors) on 2 ranks through
``kolossos train``: the logged loss of step 1 is the loss computed by hand from the JSON lines
(prompt tokens masked out); stopping and resuming repeats the uninterrupted run exactly (losses,
final checkpoint bytes; the packed data crosses epochs); the export loads with transformers and
gives the checkpoint's logits, as does the ``export=true`` folder written at the end;
``kolossos generate`` prints the same text from the run folder
and from the export."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from transformers import AutoModelForCausalLM, AutoTokenizer

from kolossos.cli import generate as generate_cli
from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.export import export_run, load_run_model
from kolossos.train.loop import StopFlag
from kolossos.train.metrics import read_metrics
from kolossos.train.packed import IGNORE_INDEX, PackedCorpus
from kolossos.train.paths import RunPaths, complete_checkpoints
from kolossos.train.tiny import make_tiny_checkpoint
from kolossos.train.worker import EXIT_INTERRUPTED, run_worker

pytestmark = pytest.mark.dist

STEPS, STOP_AT, BLOCK, BATCH, ACCUM = 6, 3, 16, 4, 2


class StopAfter(StopFlag):
    """Asks for a stop at the end of step ``k``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.reads = k, 0

    @property
    def requested(self) -> bool:
        self.reads += 1
        return self.reads >= self.k


def write_instructions(path: Path) -> list[dict[str, str]]:
    rng = random.Random(1)
    words = ["the", "king", "queen", "lord", "love", "death", "night", "day", "sword", "crown"]
    records = [
        {"prompt": "Q: " + " ".join(rng.choices(words, k=3)) + "\nA:",
         "response": " " + " ".join(rng.choices(words, k=6))}
        for _ in range(6)
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return records


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("instruct")
    model = make_tiny_checkpoint(root / "model", family="llama", weights="sharded")
    data = root / "instructions.jsonl"
    return model, data, write_instructions(data)


def hand_chunks(
    model_dir: Path, records: list[dict[str, str]]
) -> list[tuple[list[int], list[int]]]:
    """The packed sequences built by hand: prompt tokens labelled -100, then response + EOS."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    labels: list[int] = []
    for r in records:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        a = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += p + a
        labels += [IGNORE_INDEX] * len(p) + a
    n = len(ids) // BLOCK
    return [
        (ids[i * BLOCK : (i + 1) * BLOCK], labels[i * BLOCK : (i + 1) * BLOCK]) for i in range(n)
    ]


def hand_loss(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> float:
    """Mean next-token cross-entropy over every position of ``rows`` whose label is not -100."""
    total, count = 0.0, 0
    for ids, labels in rows:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        target = torch.tensor(labels[1:])
        keep = target != IGNORE_INDEX
        total += float(F.cross_entropy(logits[keep], target[keep], reduction="sum"))
        count += int(keep.sum())
    return total / count


@distributed(2)
def test_instruction_resume_export_generate(
    tmp_path: Path, setup: tuple[Path, Path, list[dict[str, str]]]
) -> None:
    model_dir, data, records = setup
    rank = dist.get_rank()
    common = [
        f"model.pretrained={model_dir}", f"data.path={data}", "data.format=instruction",
        f"model.block_size={BLOCK}", f"train.steps={STEPS}", f"train.batch_size={BATCH}",
        f"train.gradient_accumulation={ACCUM}", "train.warmup_steps=1", "train.lr=1e-2",
        "train.schedule=linear",
        "train.eval_interval=2", "train.eval_batches=1", "checkpoint.every=1",
        "sample.tokens=6", "sample.prompt=Q: the king", f"output_dir={tmp_path}", "export=true",
    ]  # fmt: skip
    configs = {n: load_config(None, [*common, f"name={n}"]) for n in ("straight", "resumed")}
    quiet = io.StringIO()
    assert run_worker(configs["straight"], stream=quiet, install_signals=False) == 0
    stopped = run_worker(configs["resumed"], stream=quiet, install_signals=False,
                         stop=StopAfter(STOP_AT))  # fmt: skip
    assert stopped == EXIT_INTERRUPTED
    dist.barrier()
    torch.manual_seed(99 + rank)  # disturb the RNG: resuming restores it
    assert run_worker(configs["resumed"], resume=True, stream=quiet, install_signals=False) == 0
    dist.barrier()
    paths = {n: RunPaths.of(str(tmp_path), n) for n in configs}
    logs = {n: read_metrics(paths[n].metrics) for n in configs}
    seen = {
        n: [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in logs[n]]
        for n in configs
    }
    assert seen["resumed"] == seen["straight"]  # exact, in fp32
    assert [s for k, s, *_ in seen["straight"] if k == "train"] == list(range(1, STEPS + 1))
    if rank != 0:
        return
    final = {n: paths[n].checkpoints / "step_000006" / "model" for n in configs}
    for file in sorted(p.name for p in final["straight"].iterdir()):
        assert (final["straight"] / file).read_bytes() == (final["resumed"] / file).read_bytes()
    assert [s for s, _ in complete_checkpoints(paths["straight"].checkpoints)] == [5, 6]

    # step 1's loss by hand: the mean over every response token of the global batch
    chunks = hand_chunks(model_dir, records)
    n_val = max(1, round(len(chunks) * 0.1))
    empty = np.zeros(0, dtype=np.int32)
    corpus = PackedCorpus(ids=empty, mask=empty, block=BLOCK, n_train=len(chunks) - n_val,
                          n_val=n_val, tokenizer=None, source="")  # fmt: skip
    assert corpus.n_train < STEPS * BATCH  # the run crosses an epoch boundary
    rows = corpus.train_indices(1, seed=configs["straight"].seed, batch_size=BATCH).tolist()
    pretrained = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        by_hand = hand_loss(pretrained, [chunks[i] for i in rows])
    step1 = next(r["loss"] for r in logs["straight"] if r["kind"] == "train" and r["step"] == 1)
    assert abs(step1 - by_hand) < 1e-5, (step1, by_hand)
    assert any(label == IGNORE_INDEX for i in rows for label in chunks[i][1])  # masks exercised

    # the export loads with transformers and computes the checkpoint's logits
    out = export_run(paths["straight"].root, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    checkpoint = load_run_model(paths["straight"].root).model
    x = torch.tensor([tokenizer("Q: the king\nA: love", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits, checkpoint(input_ids=x).logits,
                                   atol=0, rtol=0)  # fmt: skip
        moved = (exported(input_ids=x).logits - pretrained(input_ids=x).logits).abs().max()
        at_end = AutoModelForCausalLM.from_pretrained(str(paths["straight"].export))  # export=true
        torch.testing.assert_close(at_end(input_ids=x).logits, exported(input_ids=x).logits,
                                   atol=0, rtol=0)  # fmt: skip
    assert moved > 1e-3  # the export holds the fine-tuned weights, not the pretrained ones

    texts = []
    for source in (paths["straight"].root, out):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = generate_cli.main([str(source), "--prompt", "Q: the king", "--tokens", "6",
                                      "--seed", "7"])  # fmt: skip
        assert code == 0
        texts.append(buffer.getvalue())
    assert texts[0] == texts[1] and texts[0].startswith("Q: the king"), texts
