"""``autoparallelize`` on a tiny Hugging Face ViT image classifier vs one process, 2 gloo ranks.

``ViTForImageClassification`` (8 x 8 images of 3 channels, 4 x 4 patches, 2 layers, hidden 32,
4 heads, MLP 64, 5 classes, dropout 0, no q/k/v bias), batch 16 images with labels, fp32,
Adam, fixed costs (``test_autoparallelize_llama``'s with a 5x slower compute rate, so that on
this tiny model data parallelism beats replication). The patch convolution is a ``conv``
operator, the CLS token and position embeddings a ``token_params`` operator, the classifier
reads the ``[CLS]`` token and the loss is cross entropy on ``[batch, classes]`` logits. Without
a budget the search picks data parallelism; at a budget between the data-parallel and the
Megatron memory the ILP's per-operator plan (``mixed``, run by the graph executor); the
Megatron plan (``q/k/v_proj`` and ``fc1`` column, ``o_proj`` and ``fc2`` row, heads and GELU
sharded; patch embedding, CLS token, position embeddings, LayerNorms, classifier and loss
replicated), built from its plan, runs with ShardFormer's ViT policy. Each trains STEPS steps from
the same weights as a single process on the whole batch: the loss matches at every step, the
gathered parameters at the end, and every parameter moved by more than 10x the parameter
tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel import CostModel, autoparallelize
from kolossos.auto_parallel.apply_transformer import apply_family
from kolossos.auto_parallel.module_graph import trace_operators
from kolossos.auto_parallel.transformer_plan import family_plan
from kolossos.auto_parallel.transformer_strategies import transformer_graph
from kolossos.testing import distributed
from kolossos.testing.parity import assert_run_matches, global_mean, snapshot

pytestmark = pytest.mark.dist

BATCH, IMAGE, CLASSES, STEPS, LR = 16, 8, 5, 4, 1e-2
TOL = 2e-5  # fp32; only the order of sums changes (gradient average, row-parallel sums)
# Adam's eps: with the default 1e-8 Adam normalises the rounding of gradient elements near zero,
# which each plan sums in its own order, into moves of up to 1.86e-5 on one q_proj element after
# 4 steps. Under an eps of 1e-5 such elements move by their rounding times lr / eps, the others
# train as under the default: every parameter within 2.9e-6 of one process's for every plan
# (2026-11-28). The first-step gradients are checked to 1e-6 in
# tests/parity/test_autoparallelize_graph_vision.py.
ADAM_EPS = 1e-5
PARAM_TOL = 1e-5
COST = {"flops_per_s": 1e9, "alpha": 1e-6, "beta": 1e-8}


def _vit() -> torch.nn.Module:
    """No q/k/v bias: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    constant per query), so Adam would amplify rounding noise into different moves."""
    import transformers as tf

    config = tf.ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          num_labels=CLASSES, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, qkv_bias=False)  # fmt: skip
    return tf.ViTForImageClassification(config)


def _train(
    model: torch.nn.Module,
    pixels: torch.Tensor,
    labels: torch.Tensor,
    local: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses = []
    for step in range(STEPS):
        x, y = pixels[step], labels[step]
        if local is not None:
            x, y = local(x), local(y)
        loss = model(pixel_values=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@distributed(2)
def test_autoparallelize_vit_parity() -> None:
    cost = CostModel(world_size=2, **COST)
    torch.manual_seed(0)
    base = _vit()
    pixels = torch.randn(STEPS, BATCH, 3, IMAGE, IMAGE)
    labels = torch.randint(0, CLASSES, (STEPS, BATCH))
    reference = copy.deepcopy(base)
    before = snapshot(reference)
    ref_losses = _train(reference, pixels, labels)
    meta = {
        "pixel_values": torch.empty(BATCH, 3, IMAGE, IMAGE, device="meta"),
        "labels": torch.empty(BATCH, dtype=torch.long, device="meta"),
    }
    groups = trace_operators(_vit(), meta)
    dp_mem = family_plan("dp", groups, cost).memory
    tp_mem = family_plan("megatron", groups, cost).memory
    assert tp_mem < dp_mem
    # At the budget between the two the ILP's per-operator optimum (data parallel except a
    # column-parallel patch convolution and one block's MLP in Megatron column/row) beats both
    # families and runs through the graph executor; Megatron is built from its plan directly.
    for family, budget in (("dp", None), ("mixed", (dp_mem + tp_mem) / 2), ("megatron", None)):
        if family == "megatron":
            graph = transformer_graph(groups, cost)
            mesh = init_device_mesh("cpu", (2,))
            plan = family_plan("megatron", groups, cost)
            model = apply_family(copy.deepcopy(base), "megatron", plan, graph, mesh)
        else:
            model = autoparallelize(
                copy.deepcopy(base), meta, memory_budget=budget, cost_model=cost
            )
        assert model.family == family, (model.family, family)
        assert model.recompute is None
        if dist.get_rank() == 0:
            model.print_plan()
        losses = _train(model, pixels, labels, model.local_batch)
        reduced = [global_mean(x) if model.data_parallel else float(x) for x in losses]
        assert_run_matches(reduced, ref_losses, model.full_state_dict(), reference, before,
                           loss_atol=TOL, param_atol=PARAM_TOL, label=family)  # fmt: skip
