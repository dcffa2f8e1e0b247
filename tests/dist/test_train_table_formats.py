"""``kolossos train`` on 2 ranks from the same instruction records given as JSON Lines, as a
folder of Parquet files and as a ``datasets.save_to_disk`` folder: the three runs see the same
tokens, so every logged training and validation loss is identical."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths
from kolossos.train.setup import TOKEN_CACHE
from kolossos.train.tiny import make_tiny_checkpoint
from kolossos.train.worker import run_worker

pytestmark = pytest.mark.dist

WORDS = ["the", "king", "queen", "lord", "love", "death", "night", "day", "sword", "crown"]
RECORDS = [
    {"prompt": f"Q: {WORDS[i % 10]} {WORDS[(3 * i) % 10]}?\nA:",
     "response": " " + " ".join(WORDS[(i + j) % 10] for j in range(4 + i % 5))}
    for i in range(24)
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("tables")
    model = make_tiny_checkpoint(root / "model", family="llama")
    jsonl = root / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    parquet = root / "parquet"
    parquet.mkdir()
    pq.write_table(pa.Table.from_pylist(RECORDS[:10]), parquet / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[10:]), parquet / "part-1.parquet")
    saved = root / "saved"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(saved))
    return model, {"jsonl": jsonl, "parquet": parquet, "datasets": saved}


@distributed(2)
def test_parquet_and_saved_datasets_train_like_jsonl(
    tmp_path: Path, setup: tuple[Path, dict[str, Path]]
) -> None:
    model, data = setup
    common = [
        f"model.pretrained={model}", "data.instruction=true", "model.block_size=16",
        "train.steps=3", "train.batch_size=4", "train.warmup_steps=1", "train.eval_interval=3",
        "train.eval_batches=1", "train.log_interval=1", "checkpoint.every=3", "sample.tokens=4",
        f"output_dir={tmp_path}",
    ]  # fmt: skip
    seen = {}
    for fmt, path in data.items():
        config = load_config(None, [*common, f"name={fmt}", f"data.path={path}",
                                    f"data.format={fmt}"])  # fmt: skip
        assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0
        dist.barrier()
        records = read_metrics(RunPaths.of(str(tmp_path), fmt).metrics)
        seen[fmt] = [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in records]
    assert [s for k, s, *_ in seen["jsonl"] if k == "train"] == [1, 2, 3]
    assert seen["parquet"] == seen["jsonl"]  # exact: the same tokens in the same order
    assert seen["datasets"] == seen["jsonl"]
    caches = [p for p in (tmp_path / TOKEN_CACHE).iterdir() if not p.name.startswith(".")]
    assert len(caches) == 3  # each run tokenised its own data
