"""Gradient accumulation with the legacy engine: the "Gradient Accumulation (Outdated)" tutorial.

ResNet-18 on CIFAR-10 through ``kolossos.initialize``; ``config.py`` sets
``gradient_accumulation = 4``, so the engine steps the optimizer once every 4 iterations. The
script prints the first 10 elements of the first parameter after each iteration, as the tutorial
shows them: the same for iterations 0-2, different at iteration 3.

Run::

    kolossos run --nproc_per_node 1 examples/legacy/gradient_accumulation/train.py \\
        --config examples/legacy/gradient_accumulation/config.py

Changes from the tutorial: imports from ``kolossos``; the model is ``kolossos.models.resnet18``
and the data ``kolossos.datasets.CIFAR10`` (real CIFAR-10 under ``$DATA``, otherwise a synthetic
stand-in of the same shape, with a warning); ``.cuda()`` became ``.to(get_current_device())``;
``--config`` defaults to the ``config.py`` next to this file; rank 0 prints; the exit code is 1
unless the parameter changed exactly at the last iteration of the cycle (checked at full
precision, not on the printed 4 digits).
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import kolossos
from kolossos.core import global_context as gpc
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.models import resnet18
from kolossos.nn.lr_scheduler import CosineAnnealingLR
from kolossos.utils import get_current_device, get_dataloader, print_rank_0

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Run one accumulation cycle and report after which iterations the parameter moved."""
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(HERE / "config.py"))
    args = parser.parse_args()
    kolossos.launch_from_torch(config=args.config)

    # build resnet
    model = resnet18(num_classes=10)

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

    # build criterion, optimizer and lr scheduler
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=gpc.config.NUM_EPOCHS)

    engine, train_dataloader, _, lr_scheduler = kolossos.initialize(
        model, optimizer, criterion, train_dataloader, lr_scheduler=lr_scheduler
    )

    # verify gradient accumulation
    first = next(model.parameters())
    values = [first.flatten()[0].item()]
    engine.train()
    for idx, (img, label) in enumerate(train_dataloader):
        img = img.to(get_current_device())
        label = label.to(get_current_device())

        engine.zero_grad()
        output = engine(img)
        train_loss = engine.criterion(output, label)
        engine.backward(train_loss)
        engine.step()
        lr_scheduler.step()

        print_rank_0(f"iteration {idx}, first 10 elements of param: {first.flatten()[:10].data}")
        values.append(first.flatten()[0].item())
        if idx != 0 and idx % (gpc.config.gradient_accumulation - 1) == 0:
            break

    moved = [after != before for before, after in itertools.pairwise(values)]
    ok = moved == [False] * (gpc.config.gradient_accumulation - 1) + [True]
    if ok:
        print_rank_0("The parameter is only updated in the last iteration")
    else:
        print_rank_0(f"UNEXPECTED: the parameter moved at iterations {moved}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
