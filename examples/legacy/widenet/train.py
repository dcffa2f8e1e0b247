"""Mixture of experts with the legacy engine: Colossal-AI's "Integrate Mixture-of-Experts Into
Your Model" page (WideNet), at a size that trains in seconds on CPUs.

``config.py`` sets ``parallel = dict(moe=dict(size=2))``: the 4 experts of every MoE layer are
shared out over 2 consecutive processes (``ParallelMode.MOE_MODEL``), each token travels to
its experts' process and back by all-to-all, and ``kolossos.initialize`` adds
``MoeGradientHandler`` by itself (expert gradients over ``ParallelMode.MOE_DATA``, the others
over ``ParallelMode.DATA``). Run::

    kolossos run --nproc_per_node 2 examples/legacy/widenet/train.py \\
        --config examples/legacy/widenet/config.py

(4 processes: expert parallel 2 × expert data parallel 2.) Changes from the page: imports from
``kolossos`` (``model_zoo.moe.models`` is the folder next to this file, the router and
experts come from ``kolossos.moe``); synthetic images (class prototypes plus noise) instead of
ImageNet; the engine loop instead of the Trainer. The exit code is 1 if the loss did not fall,
the replicas of a parameter differ, or the experts of one expert-parallel group are equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # model_zoo/ next to this file

from model_zoo.moe.models import Widenet  # noqa: E402

import kolossos  # noqa: E402
from kolossos.context import ParallelMode  # noqa: E402
from kolossos.context.random import moe_set_seed  # noqa: E402
from kolossos.core import global_context as gpc  # noqa: E402
from kolossos.logging import get_dist_logger  # noqa: E402
from kolossos.moe import MoeLoss, is_moe_param  # noqa: E402
from kolossos.utils import get_dataloader  # noqa: E402


def synthetic_images(count: int, size: int, classes: int, seed: int = 0) -> TensorDataset:
    """``count`` images: a fixed random prototype per class plus noise (the same everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(classes, 3, size, size, generator=gen)
    labels = torch.randint(0, classes, (count,), generator=gen)
    images = prototypes[labels] + 0.8 * torch.randn(count, 3, size, size, generator=gen)
    return TensorDataset(images, labels)


def same_over(tensors: list[torch.Tensor], mode: ParallelMode) -> bool:
    """Whether ``tensors`` are bitwise equal on every rank of ``mode``'s group (collective)."""
    local = torch.cat([t.detach().flatten() for t in tensors])
    reference = local.clone()
    group = gpc.get_group(mode)
    dist.broadcast(reference, src=gpc.get_ranks_in_group(mode)[0], group=group)
    agree = torch.tensor([float(torch.equal(local, reference))])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
    return bool(agree.item())


def main() -> int:
    """Train ``TRAIN_STEPS`` steps; fail if the loss did not fall or the replicas disagree."""
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(HERE / "config.py"))
    args = parser.parse_args()
    kolossos.launch_from_torch(config=args.config, seed=1234)
    cfg = gpc.config
    logger = get_dist_logger()
    logger.info(
        f"MOE_MODEL groups of {gpc.get_world_size(ParallelMode.MOE_MODEL)}: this rank in "
        f"{gpc.get_ranks_in_group(ParallelMode.MOE_MODEL)}, MOE_DATA "
        f"{gpc.get_ranks_in_group(ParallelMode.MOE_DATA)}",
        ranks=[0],
    )

    moe_set_seed(42)
    model = Widenet(
        num_experts=cfg.NUM_EXPERTS, capacity_factor=cfg.CAPACITY_FACTOR,
        img_size=cfg.IMG_SIZE, patch_size=cfg.PATCH_SIZE, num_classes=cfg.NUM_CLASSES,
        depth=cfg.DEPTH, d_model=cfg.D_MODEL, num_heads=cfg.NUM_HEADS, d_kv=cfg.D_KV,
        d_ff=cfg.D_FF, drop_rate=cfg.DROP_RATE,
    )  # fmt: skip
    criterion = MoeLoss(aux_weight=0.01, loss_fn=nn.CrossEntropyLoss, label_smoothing=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.LEARNING_RATE)
    count = cfg.BATCH_SIZE * cfg.TRAIN_STEPS * dist.get_world_size()  # one epoch
    dataset = synthetic_images(count, cfg.IMG_SIZE, cfg.NUM_CLASSES)
    loader = get_dataloader(dataset, shuffle=True, batch_size=cfg.BATCH_SIZE, drop_last=True)
    engine, loader, _, _ = kolossos.initialize(model, optimizer, criterion, loader, verbose=False)
    handlers = [type(h).__name__ for h in engine.gradient_handlers]
    logger.info(f"gradient handlers: {handlers}", ranks=[0])

    losses: list[float] = []
    engine.train()
    batches = iter(loader)
    for step in range(1, cfg.TRAIN_STEPS + 1):
        img, label = next(batches)
        engine.zero_grad()
        output = engine(img)
        train_loss = engine.criterion(output, label)
        engine.backward(train_loss)
        engine.step()
        reported = train_loss.detach().reshape(1).clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / dist.get_world_size())
        logger.info(f"step {step} / {cfg.TRAIN_STEPS} | train loss {losses[-1]:.6f}", ranks=[0])

    dense = [p for p in model.parameters() if not is_moe_param(p)]
    experts = [p for p in model.parameters() if is_moe_param(p)]
    dense_same = same_over(dense, ParallelMode.DATA)
    experts_same = same_over(experts, ParallelMode.MOE_DATA)
    experts_differ = not same_over(experts, ParallelMode.MOE_MODEL)
    fell = sum(losses[-5:]) < 0.8 * sum(losses[:5])
    logger.info(
        f"dense parameters identical on all ranks: {dense_same}; experts identical over "
        f"MOE_DATA: {experts_same}; experts differ over MOE_MODEL: {experts_differ}; "
        f"loss fell: {fell}",
        ranks=[0],
    )
    gpc.destroy()
    return 0 if dense_same and experts_same and experts_differ and fell else 1


if __name__ == "__main__":
    sys.exit(main())
