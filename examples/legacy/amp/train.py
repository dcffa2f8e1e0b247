"""Mixed precision with the legacy engine: the "Auto Mixed Precision Training (Outdated)" tutorial.

A Vision Transformer on Caltech101 through ``kolossos.initialize``; the config's
``fp16=dict(mode=AMP_TYPE...)`` picks the AMP recipe and ``clip_grad_norm = 1.0`` clips the
(unscaled) gradients. One config file per mode: ``config_torch.py``, ``config_naive.py``,
``config_apex.py``. Each epoch logs its mean loss; the exit code is 1 if a loss was not finite.

Run::

    kolossos run --nproc_per_node 2 examples/legacy/amp/train.py \\
        --config examples/legacy/amp/config_torch.py

Changes from the tutorial: imports from ``kolossos``; timm's ``vit_base_patch16_224(drop_rate=0.1)``
became ``kolossos.models.VisionTransformer`` sized by the config (``IMG_SIZE``, ``PATCH_SIZE``,
``HIDDEN_SIZE``, ``DEPTH``, ``NUM_HEADS``, ``NUM_CLASSES``); Caltech101 is read with torchvision
(``download=False``) only when ``$DATA/caltech101`` exists and torchvision is installed,
otherwise a deterministic synthetic stand-in (``SYNTHETIC_SIZE`` images of ``SYNTHETIC_CLASSES``
classes, which the 101-way head learns within a few epochs) is used and a warning says so;
Resize(256) + RandomResizedCrop(224) follow ``IMG_SIZE``; ``Gray2RGB`` (undefined in the
tutorial) is written here; the loop fixes the tutorial's
``for img, label in enumerate(train_dataloader)``; ``.cuda()`` became
``.to(get_current_device())``; ``LinearWarmupLR`` counts iterations (the tutorial steps it every
iteration but gives ``total_steps=NUM_EPOCHS``) and warms up over ``WARMUP_STEPS`` (tutorial: 50,
more than this whole run); ``--config`` defaults to ``config_torch.py`` next to this file.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import kolossos
from kolossos.core import global_context as gpc
from kolossos.datasets import ImageTransform, SyntheticImageDataset
from kolossos.logging import get_dist_logger
from kolossos.models import VisionTransformer
from kolossos.nn.lr_scheduler import LinearWarmupLR
from kolossos.utils import get_current_device, get_dataloader

HERE = Path(__file__).resolve().parent
SYNTHETIC_SIZE = 256
SYNTHETIC_CLASSES = 10  # fewer than Caltech101's 101, so a short run learns something
WARMUP_STEPS = 2


class Gray2RGB:
    """Repeat a one-channel image to three channels (Caltech101 has grayscale images)."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.expand(3, -1, -1) if image.shape[0] == 1 else image


def build_train_dataset(root: Path, image_size: int) -> Any:
    """Caltech101 from ``root`` when it is there (and torchvision is installed), else synthetic."""
    if (root / "caltech101").is_dir():
        try:
            from torchvision import datasets, transforms
        except ImportError:
            get_dist_logger().warning("Caltech101 needs torchvision: pip install torchvision")
        else:
            return datasets.Caltech101(
                root=root,
                download=False,
                transform=transforms.Compose(
                    [
                        transforms.Resize(image_size * 8 // 7),
                        transforms.RandomResizedCrop(image_size),
                        transforms.RandomHorizontalFlip(),
                        transforms.ToTensor(),
                        Gray2RGB(),
                        transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
                    ]
                ),
            )
    get_dist_logger().warning(
        f"Caltech101 not found under {root}: using SYNTHETIC images ({SYNTHETIC_SIZE} samples, "
        f"{SYNTHETIC_CLASSES} classes); losses fall, accuracies mean nothing.",
        ranks=[0],
    )
    return SyntheticImageDataset(
        size=SYNTHETIC_SIZE,
        image_shape=(3, image_size, image_size),
        num_classes=SYNTHETIC_CLASSES,
        transform=ImageTransform([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], flip=True),
    )


def main() -> int:
    """Train ``NUM_EPOCHS`` epochs with the config's AMP mode; fail if a loss is not finite."""
    # initialize distributed setting
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(HERE / "config_torch.py"))
    args = parser.parse_args()

    # launch from torch
    kolossos.launch_from_torch(config=args.config)
    logger = get_dist_logger()
    cfg = gpc.config

    # build model
    model = VisionTransformer(
        image_size=cfg.IMG_SIZE,
        patch_size=cfg.PATCH_SIZE,
        num_classes=cfg.NUM_CLASSES,
        dim=cfg.HIDDEN_SIZE,
        depth=cfg.DEPTH,
        heads=cfg.NUM_HEADS,
        dropout=cfg.DROP_RATE,
    )

    # build dataloader
    train_dataset = build_train_dataset(Path(os.environ.get("DATA", "./data")), cfg.IMG_SIZE)
    train_dataloader = get_dataloader(
        dataset=train_dataset,
        shuffle=True,
        batch_size=cfg.BATCH_SIZE,
        num_workers=1,
        pin_memory=True,
    )

    # build optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)

    # build loss
    criterion = torch.nn.CrossEntropyLoss()

    # lr_scheduler
    lr_scheduler = LinearWarmupLR(
        optimizer, warmup_steps=WARMUP_STEPS, total_steps=cfg.NUM_EPOCHS * len(train_dataloader)
    )

    engine, train_dataloader, _, _ = kolossos.initialize(
        model,
        optimizer,
        criterion,
        train_dataloader,
    )
    logger.info(f"AMP mode: {cfg.fp16.mode}", ranks=[0])

    finite = True
    engine.train()
    for epoch in range(cfg.NUM_EPOCHS):
        losses = []
        for img, label in train_dataloader:
            img = img.to(get_current_device())
            label = label.to(get_current_device())
            engine.zero_grad()
            output = engine(img)
            loss = engine.criterion(output, label)
            engine.backward(loss)
            engine.step()
            lr_scheduler.step()
            losses.append(loss.item())
        finite = finite and all(math.isfinite(x) for x in losses)
        logger.info(f"epoch {epoch}: mean loss {sum(losses) / len(losses):.6f}", ranks=[0])

    dist.destroy_process_group()
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
