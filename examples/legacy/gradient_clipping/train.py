"""Gradient clipping with the legacy engine: the "Gradient Clipping (Outdated)" tutorial.

ResNet-34 on CIFAR-10 through ``kolossos.initialize``; ``config.py`` sets ``clip_grad_norm = 1.0``,
so ``engine.step()`` scales the (data-parallel averaged) gradients down to a global norm of at most
1.0 before the optimizer steps. A large learning rate keeps the norms above 1.0, and the script
prints each iteration's gradient norm before ``engine.step()`` and after it (the gradients the
optimizer used).

Run::

    kolossos run --nproc_per_node 1 examples/legacy/gradient_clipping/train.py \\
        --config examples/legacy/gradient_clipping/config.py

Changes from the tutorial: imports from ``kolossos``; the model is ``kolossos.models.resnet34``
and the data ``kolossos.datasets.CIFAR10`` (real CIFAR-10 under ``$DATA``, otherwise a synthetic
stand-in of the same shape, with a warning); ``.cuda()`` became ``.to(get_current_device())``;
``--config`` defaults to the ``config.py`` next to this file; each epoch stops after
``STEPS_PER_EPOCH`` iterations; the norm printing and the exit code (1 if a norm after clipping
exceeds ``clip_grad_norm``) are new.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import kolossos
from kolossos.core import global_context as gpc
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.logging import get_dist_logger
from kolossos.models import resnet34
from kolossos.utils import get_current_device, get_dataloader

HERE = Path(__file__).resolve().parent


def grad_norm(model: torch.nn.Module) -> float:
    """The global 2-norm of the model's gradients (replicated under data parallelism), summed in
    float64: one fp32 sum over millions of elements drifts by about 0.1%."""
    norms = [
        torch.linalg.vector_norm(p.grad.double()) for p in model.parameters() if p.grad is not None
    ]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def main() -> int:
    """Train a few iterations with clipping; fail if a clipped norm exceeds the limit."""
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(HERE / "config.py"))
    args = parser.parse_args()
    kolossos.launch_from_torch(config=args.config)
    logger = get_dist_logger()

    # build resnet
    model = resnet34(num_classes=10)

    # build dataloaders
    train_dataset = CIFAR10(
        root=Path(os.environ.get("DATA", "./data")),
        transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD, crop_padding=4, flip=True),
        synthetic_size=1024,
    )
    train_dataloader = get_dataloader(
        dataset=train_dataset,
        shuffle=True,
        batch_size=gpc.config.BATCH_SIZE,
        pin_memory=True,
    )

    # build criterion and optimizer
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    engine, train_dataloader, _, _ = kolossos.initialize(
        model, optimizer, criterion, train_dataloader
    )

    ok = True
    engine.train()
    for epoch in range(gpc.config.NUM_EPOCHS):
        for idx, (img, label) in enumerate(train_dataloader):
            img = img.to(get_current_device())
            label = label.to(get_current_device())

            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            before = grad_norm(model)
            engine.step()
            after = grad_norm(model)  # the gradients the optimizer stepped with

            ok = ok and after <= gpc.config.clip_grad_norm * (1 + 1e-5)
            logger.info(
                f"epoch {epoch} iteration {idx}: loss {train_loss.item():.4f}, "
                f"grad norm before clipping {before:.4f}, after clipping {after:.4f}",
                ranks=[0],
            )
            if idx + 1 == gpc.config.STEPS_PER_EPOCH:
                break

    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
