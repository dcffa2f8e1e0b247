"""Gradient clipping with the Booster: the "Gradient Clipping (Latest)" tutorial.

ResNet-34 on CIFAR-10 with ``TorchDDPPlugin`` and fp16 (torch AMP). After ``booster.backward``,
``optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)`` unscales the gradients and clips their
global norm to 0.1 before ``optimizer.step()``. Each iteration logs the loss, the gradient norm
before clipping and the first parameter element; the tutorial runs 4 iterations.

Run::

    kolossos run --nproc_per_node 1 examples/gradient_clipping_with_booster.py
    kolossos run --nproc_per_node 2 examples/gradient_clipping_with_booster.py --steps 2

fp16 on a CPU is emulated and slow (about 2 s per ResNet-34 step at batch 4); on a GPU the
tutorial's ``--batch_size 128`` is quick. With the default initial loss scale (2**16) the first
steps overflow and are skipped while the scale backs off (the log says so); ``--init_scale 1024``
shows clipping from the first step.

Changes from the tutorial (see ``examples/README.md``): imports from ``kolossos``; the model is
``kolossos.models.resnet34`` and the data ``kolossos.datasets.CIFAR10`` (synthetic when CIFAR-10
is not under ``$DATA``); ``.cuda()`` became ``.to(get_current_device())``; ``CosineAnnealingLR``
comes from ``kolossos.nn.lr_scheduler`` when that module exists, else it is torch's scheduler with
``T_max=total_steps`` (the same schedule); the unused ``tqdm`` import is gone; the log line also
shows the norm ``clip_grad_by_norm`` returns (or that the step was skipped for fp16 overflow);
``--batch_size`` (tutorial: 128), ``--steps`` (tutorial: 4), ``--download`` and ``--init_scale``
flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.logging import get_dist_logger
from kolossos.mixed_precision import FP16TorchMixedPrecision
from kolossos.models import resnet34
from kolossos.nn.lr_scheduler import CosineAnnealingLR
from kolossos.utils import get_current_device


def parse_args() -> argparse.Namespace:
    """The launcher's arguments plus this example's size flags."""
    parser = kolossos.get_default_parser()
    parser.add_argument("--batch_size", type=int, default=4, help="per rank (tutorial: 128)")
    parser.add_argument("--steps", type=int, default=4, help="iterations (tutorial: 4)")
    parser.add_argument("--download", action="store_true", help="fetch CIFAR-10 if missing")
    parser.add_argument(
        "--init_scale",
        type=float,
        default=None,
        help="initial fp16 loss scale (default: the 'fp16' recipe's 2**16, as in the tutorial)",
    )
    return parser.parse_args()


def describe_clipping(grad_norm: torch.Tensor, optimizer: Any) -> str:
    """The norm ``clip_grad_by_norm`` returned, or why the step was skipped."""
    if torch.isfinite(grad_norm):
        return f"grad norm before clipping: {grad_norm.item():.4g}"
    # The dynamic loss scale starts high and backs off: early fp16 steps may overflow.
    return f"step skipped: fp16 overflow (loss scale now {optimizer.loss_scale:g})"


def main() -> int:
    """Train ``--steps`` iterations with fp16 and gradient clipping; log each one."""
    args = parse_args()
    kolossos.launch_from_torch(config=dict())
    logger = get_dist_logger()

    # define training hyperparameters
    NUM_EPOCHS = 200
    BATCH_SIZE = args.batch_size
    GRADIENT_CLIPPING = 0.1
    # build resnet
    model = resnet34(num_classes=10)
    # build dataloaders
    train_dataset = CIFAR10(
        root=Path(os.environ.get("DATA", "./data")),
        download=args.download,
        # RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize(mean, std)
        transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD, crop_padding=4, flip=True),
    )
    # build criterion
    criterion = torch.nn.CrossEntropyLoss()
    # optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    # lr_scheduler
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=NUM_EPOCHS)

    plugin = TorchDDPPlugin()
    if args.init_scale is None:
        booster = Booster(mixed_precision="fp16", plugin=plugin)
    else:
        mixed_precision = FP16TorchMixedPrecision(init_scale=args.init_scale)
        booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
    )
    model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, train_dataloader, lr_scheduler
    )

    # verify gradient clipping
    skipped = 0
    model.train()
    for idx, (img, label) in enumerate(train_dataloader):
        img = img.to(get_current_device())
        label = label.to(get_current_device())

        model.zero_grad()
        output = model(img)
        train_loss = criterion(output, label)
        booster.backward(train_loss, optimizer)
        grad_norm = optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)
        optimizer.step()
        lr_scheduler.step()

        skipped += int(not torch.isfinite(grad_norm))
        ele_1st = next(model.parameters()).flatten()[0]
        logger.info(
            f"iteration {idx}, loss: {train_loss}, 1st element of parameters: {ele_1st.item()}, "
            f"{describe_clipping(grad_norm, optimizer)}",
            ranks=[0],
        )

        # only run for 4 iterations
        if idx == args.steps - 1:
            break

    if skipped:
        logger.info(
            f"{skipped} of {idx + 1} steps were skipped for fp16 overflow while the loss scale "
            "backed off; a lower --init_scale (default 2**16), e.g. 1024, skips fewer",
            ranks=[0],
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
