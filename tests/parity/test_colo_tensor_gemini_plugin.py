"""``booster.boost`` with ``GeminiPlugin(colo_process_group=pg)`` over an unmodified Hugging Face
GPT-2 built under ``ColoInitContext(default_pg=pg)`` and sharded by the documents'
``tensor_parallelize`` recipe, on 4 CPU ranks with tp=2 x dp=2, trains like the single-process
model: loss every step, full parameters at the end, every parameter moved far beyond the
tolerance; with ``max_norm`` small enough that every step clips, the global gradient norm (each
tp piece once, replicated parameters once) equals the single-process one at every step. The
plugin's dataloader gives both tp ranks of a dp group the same samples, and
``booster.save_model`` writes full tensors that a fresh ``GPT2LMHeadModel`` loads with equal
logits.

Tiny model: 2 layers, hidden 32, 4 heads, vocabulary 64, sequence 8, dropout off, eager
attention, fp32, AdamW (HybridAdam in adamw mode).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from kolossos.booster import Booster
from kolossos.booster.plugin import GeminiPlugin
from kolossos.nn.optimizer import HybridAdam
from kolossos.tensor import ColoParameter, ProcessGroup
from kolossos.testing import distributed
from kolossos.testing.parity import assert_moved, global_mean, snapshot
from kolossos.utils.model.colo_init_context import ColoInitContext

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "tensor"))
from gpt2_tp_recipe import tensor_parallelize  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 4
SEQ = 8
VOCAB = 64
# clipping: the gradient norm of this model is ~2-4 at these steps; 0.5 clips every step
MAX_NORM = 0.5
# fp32: tensor parallelism and Gemini change only the order of sums; measured worst ~1e-6
TOL = 1e-5


def build() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def run(max_norm: float, tmp: Path) -> None:
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    torch.manual_seed(0)
    ref = build()
    with ColoInitContext(device="cpu", default_pg=pg):
        model = build()
    assert all(isinstance(p, ColoParameter) for p in model.parameters())
    with torch.no_grad():  # the same start as the reference
        for (_, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            p.copy_(
                DTensor.from_local(r.detach().clone(), p.device_mesh, run_check=False).redistribute(
                    p.device_mesh, p.placements
                )
            )
    tensor_parallelize(model, pg)
    initial = snapshot(ref)

    plugin = GeminiPlugin(
        placement_policy="static", precision="fp32", max_norm=max_norm, colo_process_group=pg
    )
    assert plugin.dp_size == 2 and plugin.dp_rank == pg.dp_local_rank()
    data = torch.randint(
        0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1)
    )
    loader = plugin.prepare_dataloader(TensorDataset(data), batch_size=GLOBAL_BATCH // 2)
    booster = Booster(plugin=plugin)
    optimizer = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3, adamw_mode=True)
    model, optimizer, *_ = booster.boost(model, optimizer)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)

    dp_group, tp_group = pg.dp_process_group(), pg.tp_process_group()
    for step, (mine,) in enumerate(loader):
        # the tp ranks of a dp group read the same samples, the dp groups different ones
        peers = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(peers, mine, group=tp_group)
        assert torch.equal(peers[0], peers[1]), step
        dist.all_gather(peers, mine, group=dp_group)
        assert not torch.equal(peers[0], peers[1]), step
        # DistributedSampler without shuffling: dp rank r holds samples r, r + 2, ...
        ids = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        torch.testing.assert_close(torch.cat([ids[0::2], ids[1::2]]), torch.cat(peers))
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm or float("inf"))
        ref_opt.step()
        ref_opt.zero_grad()

        loss = model(input_ids=mine, labels=mine).loss
        booster.backward(loss, optimizer)
        if max_norm:
            assert ref_norm > 2 * max_norm, (step, ref_norm)  # the step does clip
            # the global norm (a max_norm too large to clip): each piece counted once
            norm = optimizer.clip_grad_by_norm(1e9)
            assert abs(float(norm) - float(ref_norm)) <= TOL * float(ref_norm), (step, norm)
        optimizer.step()
        optimizer.zero_grad()
        local = loss.full_tensor() if isinstance(loss, DTensor) else loss
        got = global_mean(local, dp_group)
        assert abs(got - ref_loss.item()) <= TOL, (step, got, ref_loss.item())
    assert step == STEPS - 1

    # booster.save_model: full Hugging Face tensors, written by world rank 0
    path = tmp / f"model_{max_norm}.pt"
    booster.save_model(model, str(path))
    dist.barrier()
    state = torch.load(path, map_location="cpu", weights_only=True)
    fresh = build()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    final = dict(fresh.named_parameters())
    for name, value in ref.named_parameters():
        torch.testing.assert_close(final[name], value, rtol=TOL, atol=TOL, msg=name)
    assert_moved(initial, {n: p.detach() for n, p in final.items()}, atol=TOL)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=ids).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    torch.testing.assert_close(fresh(input_ids=ids).logits, logits, rtol=TOL, atol=TOL)
    # what is not supported says so (on every rank, before any collective)
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        booster.save_optimizer(optimizer, str(tmp / "optim.pt"))
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        booster.load_model(model, str(path))


@distributed(4)
def test_gpt2_tp2_gemini_plugin_dp2(tmp_path: Path) -> None:
    run(0.0, tmp_path)
    run(MAX_NORM, tmp_path)
    # a tensor-parallel model boosted by a plugin that does not know its ProcessGroup
    pg = ProcessGroup(tp_degree=2, dp_degree=2)
    with ColoInitContext(device="cpu", default_pg=pg):
        model = build()
    with pytest.raises(ValueError, match="colo_process_group"):
        Booster(plugin=GeminiPlugin(precision="fp32")).boost(model)
