"""bf16 gradient shards (GeminiOptimizer with HybridAdam in bf16) train exactly as fp32 ones.

The reduction produces bf16 gradients; fp32 shards hold them widened, bf16 shards as they are
and the update widens them (``kolossos/zero/gemini/gemini_optimizer.py``). So the same run with
the chunks' ``grad_dtype`` set back to fp32 (the one switch) must give bit-identical parameters:
with clipping by norm that bites (the factor deferred to the update), clipping by value after it
(the factor applied first), and a step that accumulates two backward passes (the shard widened
before the second is added). The shards stay bf16 exactly in the steps without accumulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.nn.optimizer import HybridAdam
from kolossos.testing import distributed
from kolossos.testing.parity import assert_moved, shard
from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer

WIDTH, BATCH, STEPS = 64, 8, 4
MAX_NORM = 0.05
ACCUMULATE = 2  # the step that runs two backward passes


def _train(
    narrow: bool, nvme: float = 0.0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[set]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 4))
    gemini = GeminiDDP(model, chunk_config_dict={"chunk_size": 2048},
                       mixed_precision=torch.bfloat16)  # fmt: skip
    adam = HybridAdam(gemini.parameters(), lr=1e-2, nvme_offload_fraction=nvme)
    opt = GeminiOptimizer(adam, gemini)
    chunks = list(gemini.chunk_manager)
    # a chunk with a view whose states stream from NVMe keeps fp32 shards, the others bf16
    streamed = {c.chunk_id for c, *_, view in opt.slices if adam.is_streamed(view)}
    assert bool(streamed) == (nvme > 0) and len(streamed) < len(chunks)
    for c in chunks:
        assert c.grad_dtype == (torch.float32 if c.chunk_id in streamed else torch.bfloat16)
    if not narrow:
        for chunk in chunks:
            chunk.grad_dtype = torch.float32
    before = {str(c.chunk_id): c.master.clone() for c in chunks}
    gen = torch.Generator().manual_seed(1)
    dtypes = []
    for step in range(STEPS):
        for _ in range(2 if step == ACCUMULATE else 1):
            x = shard(torch.randn(BATCH, WIDTH, generator=gen), rank, world)
            opt.backward(gemini(x.bfloat16()).float().pow(2).mean())
        dtypes.append({c.grad_shard.dtype for c in chunks if c.grad_shard is not None})
        norm = opt.clip_grad_by_norm(MAX_NORM)
        assert float(norm) > 2 * MAX_NORM, float(norm)  # the clipping bites
        if step == STEPS - 1:
            opt.clip_grad_by_value(1e-3)
        opt.step()
        opt.zero_grad()
    adam.close()
    return before, {str(c.chunk_id): c.master for c in chunks}, dtypes


@distributed(2)
def test_bf16_gradient_shards_train_bit_identically() -> None:
    before, narrow, narrow_dtypes = _train(narrow=True)
    _, wide, wide_dtypes = _train(narrow=False)
    assert all(seen == {torch.float32} for seen in wide_dtypes)
    for step, seen in enumerate(narrow_dtypes):
        assert seen == {torch.float32 if step == ACCUMULATE else torch.bfloat16}, (step, seen)
    for name, value in wide.items():
        torch.testing.assert_close(narrow[name], value, rtol=0, atol=0, msg=name.__add__)
    assert_moved(before, narrow, atol=1e-3)


@distributed(2)
def test_nvme_streamed_chunks_keep_fp32_shards_and_train_bit_identically() -> None:
    """Half of HybridAdam's states on NVMe: the chunks with streamed views keep fp32 gradient
    shards (asserted in ``_train``), the others stay bf16, and training is bit-identical to
    all-bf16 shards in memory."""
    before, in_memory, _ = _train(narrow=True)
    _, streamed, dtypes = _train(narrow=True, nvme=0.5)
    assert all(seen == {torch.float32, torch.bfloat16} for seen in dtypes[:ACCUMULATE]), dtypes
    for name, value in in_memory.items():
        torch.testing.assert_close(streamed[name], value, rtol=0, atol=0, msg=name.__add__)
    assert_moved(before, streamed, atol=1e-3)
