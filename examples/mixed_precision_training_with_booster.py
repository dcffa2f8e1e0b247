"""Mixed precision with the Booster: the "Auto Mixed Precision Training (Latest)" tutorial.

A Vision Transformer trained with ``Booster(mixed_precision='fp16', plugin=TorchDDPPlugin())``:
forward and loss run under fp16 autocast, the loss is scaled dynamically and steps that overflow
are skipped. ``--use_mixed_precision_object`` passes the tutorial's customised
``FP16TorchMixedPrecision(...)`` object instead of the string.

Run::

    kolossos run --nproc_per_node 1 examples/mixed_precision_training_with_booster.py
    kolossos run --nproc_per_node 2 examples/mixed_precision_training_with_booster.py \\
        --use_mixed_precision_object

The tutorial's sizes (ViT-B/16 at 224x224, batch 128) are
``--model vit_base --image_size 224 --patch_size 16 --batch_size 128 --steps 0``; they need a GPU.

Changes from the tutorial (see ``examples/README.md``): imports from ``kolossos``; timm's
``vit_base_patch16_224(drop_rate=0.1)`` became ``kolossos.models.vit_tiny`` (``--model``, with
``dropout=0.1`` and 10 classes) at 32x32 with 8x8 patches; Caltech101 (not available here)
became CIFAR-10 from ``kolossos.datasets`` (synthetic when it is not under ``$DATA``), resized to
``--image_size`` instead of Resize(256) + RandomResizedCrop(224), with the tutorial's flip,
``Gray2RGB`` (undefined in the tutorial; written here) and Normalize(0.5, 0.5); the unused titans
import is gone; ``LinearWarmupLR`` comes from ``kolossos.nn.lr_scheduler`` when that module exists,
else a ``LambdaLR`` with linear warm-up and linear decay; ``.cuda()`` became
``.to(get_current_device())``; the loop fixes the tutorial's ``for img, label in
enumerate(train_dataloader)`` and boosts ``train_dataloader`` (the tutorial passes an undefined
``dataloader``); each epoch stops after ``--steps`` iterations (0: the whole epoch) and logs its
last loss; the exit code is 1 if a loss was not finite.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.datasets import CIFAR10, ImageTransform
from kolossos.logging import get_dist_logger
from kolossos.mixed_precision import FP16TorchMixedPrecision
from kolossos.models import vit_base, vit_small, vit_tiny
from kolossos.nn.lr_scheduler import LinearWarmupLR
from kolossos.utils import get_current_device

MODELS = {"vit_tiny": vit_tiny, "vit_small": vit_small, "vit_base": vit_base}


class Gray2RGB:
    """Repeat a one-channel image to three channels; RGB images pass through."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.expand(3, -1, -1) if image.shape[0] == 1 else image


class TrainTransform:
    """ToTensor + RandomHorizontalFlip, resize to ``image_size``, Gray2RGB, Normalize(0.5, 0.5)."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self.to_tensor_and_flip = ImageTransform(flip=True)
        self.gray2rgb = Gray2RGB()
        self.normalize = ImageTransform(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        out = self.to_tensor_and_flip(image)
        if out.shape[-1] != self.image_size:
            size = (self.image_size, self.image_size)
            out = F.interpolate(out[None], size=size, mode="bilinear", align_corners=False)[0]
        return self.normalize(self.gray2rgb(out))


def parse_args() -> argparse.Namespace:
    """The launcher's arguments plus this example's size and precision flags."""
    parser = kolossos.get_default_parser()
    parser.add_argument("--model", choices=sorted(MODELS), default="vit_tiny")
    parser.add_argument("--image_size", type=int, default=32, help="tutorial: 224")
    parser.add_argument("--patch_size", type=int, default=8, help="tutorial: 16")
    parser.add_argument("--batch_size", type=int, default=4, help="per rank (tutorial: 128)")
    parser.add_argument("--steps", type=int, default=2, help="iterations per epoch (0: all)")
    parser.add_argument("--download", action="store_true", help="fetch CIFAR-10 if missing")
    parser.add_argument(
        "--use_mixed_precision_object",
        action="store_true",
        help="Booster(mixed_precision=FP16TorchMixedPrecision(...)) instead of 'fp16'",
    )
    return parser.parse_args()


def main() -> int:
    """Train ``NUM_EPOCHS`` short epochs with fp16 AMP; fail if a loss is not finite."""
    # initialize distributed setting
    args = parse_args()
    # launch from torch
    kolossos.launch_from_torch(config=dict())
    logger = get_dist_logger()

    # define the constants
    NUM_EPOCHS = 2
    BATCH_SIZE = args.batch_size

    # build model
    model = MODELS[args.model](
        num_classes=10, image_size=args.image_size, patch_size=args.patch_size, dropout=0.1
    )

    # build dataloader
    train_dataset = CIFAR10(
        root=Path(os.environ.get("DATA", "./data")),
        download=args.download,
        transform=TrainTransform(args.image_size),
    )

    # build optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)

    # build loss
    criterion = torch.nn.CrossEntropyLoss()

    # lr_scheduler
    lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=50, total_steps=NUM_EPOCHS)

    plugin = TorchDDPPlugin()
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
    )
    if not args.use_mixed_precision_object:
        booster = Booster(mixed_precision="fp16", plugin=plugin)
    else:
        # if you need to customize the config, do like this
        mixed_precision = FP16TorchMixedPrecision(
            init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
        )
        booster = Booster(mixed_precision=mixed_precision, plugin=plugin)

    # boost model, optimizer, criterion, dataloader, lr_scheduler
    model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, train_dataloader, lr_scheduler
    )

    finite = True
    model.train()
    for epoch in range(NUM_EPOCHS):
        for idx, (img, label) in enumerate(train_dataloader):
            img = img.to(get_current_device())
            label = label.to(get_current_device())
            optimizer.zero_grad()
            output = model(img)
            loss = criterion(output, label)
            booster.backward(loss, optimizer)
            optimizer.step()
            finite = finite and math.isfinite(loss.item())
            if idx + 1 == args.steps:
                break
        lr_scheduler.step()
        logger.info(f"epoch {epoch}, loss: {loss.item():.4f}", ranks=[0])

    dist.destroy_process_group()
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
