"""Streaming a sharded Hugging Face checkpoint into a sharded model: each rank reads its share.

A pipeline stage reads its own layers, a tensor-parallel rank its slices (safetensors
``get_slice``), a Gemini rank the tensors touching its chunk shards, an FSDP rank its rows. The
bytes each rank reads are counted through the engine's read plan, and the loaded model's loss
must equal the loss of the checkpoint's model run eagerly in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kolossos.booster import Booster
from kolossos.booster.plugin import GeminiPlugin, HybridParallelPlugin, TorchFSDPPlugin
from kolossos.checkpoint_io.model_files import find_model_checkpoint
from kolossos.checkpoint_io.read_plan import TensorSource, narrow_selector
from kolossos.checkpoint_io.state_check import compare_model_state
from kolossos.lazy import LazyInitContext
from kolossos.nn.layer.parallel_1d import TPShardSpec, slice_tp_shard, tp_shard_pieces
from kolossos.testing import distributed

transformers = pytest.importorskip("transformers")
SEQ = 8


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, int]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="100KB", safe_serialization=True)
    with torch.no_grad():
        loss = model(**_batch()).loss.item()
    return path, loss, sum(t.numel() * t.element_size() for t in model.state_dict().values())


PLUGINS = {
    "tp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"),
    "pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=1, precision="fp32"),
    "gemini": lambda: GeminiPlugin(
        precision="fp32", hidden_dim=64, search_range_m=0.01, min_chunk_size_m=0.01
    ),
    "fsdp": lambda: TorchFSDPPlugin(),
}


#: the most a rank may read, as a fraction of the checkpoint: half, plus replicated norms (TP,
#: FSDP's odd rows) or the stage's embeddings (PP); Gemini reads every parameter that touches
#: its half of a chunk whole, and at these sizes most chunks cut a parameter
SHARE = {"tp2": 0.6, "pp2": 0.6, "fsdp": 0.6, "gemini": 0.75}


def _loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


@distributed(2)
@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_each_rank_reads_its_share(name: str, checkpoint: tuple[Path, float, int]) -> None:
    path, reference, total = checkpoint
    plugin: Any = PLUGINS[name]()
    with LazyInitContext():
        model = transformers.LlamaForCausalLM(_config())
    booster = Booster(plugin=plugin)
    model, *_ = booster.boost(model)
    io = booster.checkpoint_io
    source = find_model_checkpoint(path)
    _, wanted = compare_model_state(io.model_layout(model), source.infos())
    plan = io.model_read_plan(model)
    pieces = source.iter_pieces(wanted, plan)
    read = sum(t.numel() * t.element_size() for piece in pieces for t in piece.values())
    assert read <= SHARE[name] * total, (name, read, total)
    booster.load_model(model, str(path))
    if plugin.support_pipeline() and plugin.pp_size > 1:  # (a pipeline step runs backward)
        out = booster.execute_pipeline(iter([_batch()]), model, _loss, None)
        loss = out["loss"] if out["loss"] is not None else torch.zeros(())
    else:
        with torch.no_grad():
            loss = model(**_batch()).loss
    value = loss.detach().float().reshape(1)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    assert value.item() == pytest.approx(reference, rel=1e-4), (name, value.item(), reference)


@distributed(2)
def test_tp_read_pieces_cut_what_slice_tp_shard_cuts() -> None:
    """Padded vocabularies and fused q/k/v blocks included, for both ranks."""
    world = dist.group.WORLD
    assert world is not None
    full = torch.arange(7 * 3 * 2, dtype=torch.float32).view(7, 3, 2)
    fused = torch.arange(12 * 5, dtype=torch.float32).view(12, 5)
    specs = [
        (full, TPShardSpec(dim=0, full_shape=(7, 3, 2), padded=1, group=world)),
        (full, TPShardSpec(dim=0, full_shape=(7, 3, 2), padded=3, group=world)),
        (
            fused,
            TPShardSpec(
                dim=0, full_shape=(12, 5), fused_sections=(4, 4, 4), group=world
            ),
        ),
        (fused, TPShardSpec(dim=1, full_shape=(12, 4), group=world)),
    ]
    for tensor, spec in specs:
        if tuple(tensor.shape) != spec.full_shape:
            tensor = tensor[:, :4]
        for rank in range(2):
            pieces, pad = tp_shard_pieces(spec, rank)
            got = narrow_selector(pieces, pad)(TensorSource(tensor))
            assert torch.equal(got, slice_tp_shard(tensor, spec, rank)), (spec, rank)
