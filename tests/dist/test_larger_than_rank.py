"""A model larger than one rank's memory budget trains: built lazily, sharded by the plugin, its
weights streamed from a sharded Hugging Face checkpoint, on 4 ranks.

The budget is 85% of the model's fp32 size, so an eager build alone (the whole fp32 model in every
process) would break it before any sharding. Every rank measures its tensor memory from before
the lazy build to after the last step with ``TensorMemoryTracker`` (what it allocates — the shards
it materialises, the checkpoint pieces it reads, chunks it gathers, gradients, activations) and
must stay inside the budget. The first loss must equal the loss of the checkpoint's model run
eagerly in one process (the weights really came from the files), and training must lower it.

SGD without momentum: Adam's two fp32 states alone (8 bytes a parameter) over 4 ranks are half the
fp32 model, so "larger than a rank" with Adam needs more ranks than this 2-core machine runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kolossos.accelerator.memory_tracker import TensorMemoryTracker
from kolossos.booster import Booster
from kolossos.booster.plugin import GeminiPlugin, HybridParallelPlugin
from kolossos.lazy import LazyInitContext
from kolossos.testing import distributed

BATCH, SEQ, STEPS = 2, 8, 3
BUDGET_FRACTION = 0.85
transformers = pytest.importorskip("transformers")


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 1024, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, int]:
    """A sharded HF checkpoint (safetensors shards + index) of the model, its loss on the batch
    and its fp32 size in bytes."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="3MB", safe_serialization=True)
    assert len(list(path.glob("*.safetensors"))) > 3
    assert (path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        loss = model(**_batch()).loss.item()
    size = sum(p.numel() * 4 for p in model.parameters())
    return path, loss, size


def _train(plugin: Any, path: Path, budget: int) -> tuple[list[float], int]:
    with TensorMemoryTracker() as tracker:
        with LazyInitContext():
            model = transformers.LlamaForCausalLM(_config())
        optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.05)
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(model, optimizer)
        booster.load_model(model, str(path))
        losses = []
        for _ in range(STEPS):
            if plugin.support_pipeline() and plugin.pp_size > 1:
                out = booster.execute_pipeline(iter([_batch()]), model, _loss, optimizer)
                loss = out["loss"] if out["loss"] is not None else torch.zeros(())
            else:
                loss = model(**_batch()).loss
                booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            value = loss.detach().float().reshape(1)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)  # the last stage's loss, everywhere
            losses.append(value.item())
    return losses, tracker.peak_bytes


def _loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


def _check(losses: list[float], peak: int, reference: float, size: int, what: str) -> None:
    budget = int(BUDGET_FRACTION * size)
    assert size > budget  # an eager build alone would not fit
    peaks = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        print(f"{what}: fp32 model {size / 2**20:.1f} MiB, budget {budget / 2**20:.1f} MiB, "
              f"peaks {[round(p / 2**20, 1) for p in peaks]} MiB, losses {losses}")  # fmt: skip
    assert max(peaks) <= budget, (what, peaks, budget)
    assert losses[0] == pytest.approx(reference, rel=1e-4), (what, losses[0], reference)
    assert losses[-1] < losses[0] - 0.01, (what, losses)


@distributed(4, timeout=600)
def test_gemini_trains_a_model_larger_than_a_rank(checkpoint: tuple[Path, float, int]) -> None:
    path, reference, size = checkpoint
    plugin = GeminiPlugin(
        precision="fp32", hidden_dim=256, search_range_m=0.1, min_chunk_size_m=0.1
    )
    losses, peak = _train(plugin, path, int(BUDGET_FRACTION * size))
    _check(losses, peak, reference, size, "gemini")


@distributed(4, timeout=600)
def test_tp_pp_trains_a_model_larger_than_a_rank(checkpoint: tuple[Path, float, int]) -> None:
    path, reference, size = checkpoint
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, precision="fp32")
    losses, peak = _train(plugin, path, int(BUDGET_FRACTION * size))
    _check(losses, peak, reference, size, "tp2 x pp2")
