"""The zoo's pipeline builders on 2 pipeline ranks (CPU/gloo): ``build_pipeline_vit`` gives each
rank its uniform share of the blocks (embedding first, norm and head last; chunks for
interleaving), and ``GPT2_exlarge_pipeline_hybrid`` at small size ties the first stage's word
embedding to the last stage's head (equal values after the build, the gradient handler's mark)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import kolossos
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.legacy.models.vit import ViTBlock, ViTEmbedding, ViTHead
from kolossos.model_zoo.gpt import GPT2_exlarge_pipeline_hybrid
from kolossos.model_zoo.vit import build_pipeline_vit
from kolossos.testing import spawn

pytestmark = pytest.mark.dist

VIT = dict(img_size=8, patch_size=4, dim=16, depth=4, num_heads=2, num_classes=3)
GPT = dict(num_layers=4, hidden_size=16, num_attention_heads=2, vocab_size=40,
           max_position_embeddings=8)  # fmt: skip


def _kinds(stage: nn.Module) -> list[type]:
    return [type(m) for m in stage.layers]


def _run(rank: int, world_size: int, port: int) -> None:
    kolossos.launch(dict(parallel=dict(pipeline=2)), rank, world_size, "localhost", port,
                    verbose=False)  # fmt: skip
    stage_id = gpc.get_local_rank(ParallelMode.PIPELINE)
    vit = build_pipeline_vit(num_layers=4, num_chunks=1, **VIT)
    if stage_id == 0:
        assert _kinds(vit) == [ViTEmbedding, ViTBlock, ViTBlock]
    else:
        assert _kinds(vit) == [ViTBlock, ViTBlock, nn.LayerNorm, ViTHead]
    chunks = build_pipeline_vit(num_layers=4, num_chunks=2, **VIT)
    assert isinstance(chunks, nn.ModuleList) and len(chunks) == 2
    assert (ViTEmbedding in _kinds(chunks[0])) == (stage_id == 0)
    assert (ViTHead in _kinds(chunks[1])) == (stage_id == 1)

    torch.manual_seed(rank)  # different draws per rank: the tie must make them equal
    gpt = GPT2_exlarge_pipeline_hybrid(num_chunks=1, **GPT)
    assert len(gpt.blocks) == 2
    tied = gpt.embedding.word_embeddings.weight if stage_id == 0 else gpt.head.weight
    assert tied.shape == (40, 16) and hasattr(tied, "pipeline_shared_module_pg")
    both = [torch.empty_like(tied) for _ in range(world_size)]
    dist.all_gather(both, tied.detach().contiguous())
    assert torch.equal(both[0], both[1])
    ids = torch.randint(0, 40, (2, 8))
    mask = torch.ones(2, 8)
    if stage_id == 0:
        assert gpt(input_ids=ids, attention_mask=mask).shape == (2, 8, 16)
    else:
        assert gpt(torch.randn(2, 8, 16), attention_mask=mask).shape == (2, 8, 40)


def test_zoo_pipeline_builders() -> None:
    spawn(_run, 2)
