"""ResNet-34 on CIFAR-10 with the legacy Engine and Trainer: the "Use Engine and Trainer in
Training" tutorial (``run_resnet_cifar10_with_engine.py`` and
``run_resnet_cifar10_with_trainer.py`` in one script).

Steps 1-4 (config, launch, components, ``kolossos.initialize``) are shared; step 5 trains with
the engine loop, step 6 with ``Trainer.fit`` and the tutorial's hooks. ``--mode`` picks one
(default: both, each on freshly built components).

Run::

    kolossos run --nproc_per_node 2 examples/legacy/resnet_engine_trainer/train.py
    torchrun --standalone --nproc_per_node 1 \\
        examples/legacy/resnet_engine_trainer/train.py --mode trainer

Changes from the tutorial: imports from ``kolossos``; ``torchvision``'s ``resnet34`` and
``CIFAR10`` became ``kolossos.models.resnet34`` and ``kolossos.datasets.CIFAR10`` (real CIFAR-10
from ``$DATA``, default ``./data``, when its files are there; otherwise deterministic synthetic
data of the same shape with a warning, ``--train_size``/``--test_size`` samples; ``--download``
fetches the real set), with the tutorial's crop/flip/normalise pipeline as one
``ImageTransform``; the config is the ``config.py`` next to this script unless ``--config`` is
given (the tutorial's ``'./config.py'`` depends on the working directory); ``.cuda()`` became
``.to(get_current_device())``; the tutorial's ``pin_memory=True`` is kept (ignored on a CPU-only
machine).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

import kolossos
from kolossos.core import global_context as gpc
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.logging import get_dist_logger
from kolossos.models import resnet34
from kolossos.nn.lr_scheduler import CosineAnnealingLR
from kolossos.nn.metric import Accuracy
from kolossos.trainer import Trainer, hooks
from kolossos.utils import get_current_device, get_dataloader

CONFIG = Path(__file__).with_name("config.py")


def parse_args() -> argparse.Namespace:
    """The launcher's arguments plus this example's flags."""
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(CONFIG))
    parser.add_argument("--mode", choices=("engine", "trainer", "both"), default="both")
    parser.add_argument("--train_size", type=int, default=16, help="synthetic train samples")
    parser.add_argument("--test_size", type=int, default=8, help="synthetic test samples")
    parser.add_argument("--download", action="store_true", help="fetch CIFAR-10 if missing")
    return parser.parse_args()


def build_components(args: argparse.Namespace) -> tuple[Any, ...]:
    """Step 3: model, datasets, dataloaders, criterion, optimizer and LR scheduler; step 4:
    ``kolossos.initialize``."""
    # build resnet
    model = resnet34(num_classes=10)

    # build datasets
    root = Path(os.environ.get("DATA", "./data"))
    train_dataset = CIFAR10(
        root=root,
        download=args.download,
        # RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize(mean, std)
        transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD, crop_padding=4, flip=True),
        synthetic_size=args.train_size,
    )
    test_dataset = CIFAR10(
        root=root,
        train=False,
        transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD),  # ToTensor, Normalize(mean, std)
        synthetic_size=args.test_size,
    )

    # build dataloaders
    train_dataloader = get_dataloader(
        dataset=train_dataset,
        shuffle=True,
        batch_size=gpc.config.BATCH_SIZE,
        num_workers=1,
        pin_memory=True,
    )
    test_dataloader = get_dataloader(
        dataset=test_dataset,
        add_sampler=False,
        batch_size=gpc.config.BATCH_SIZE,
        num_workers=1,
        pin_memory=True,
    )

    # build criterion
    criterion = torch.nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    # lr_scheduler
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=gpc.config.NUM_EPOCHS)

    engine, train_dataloader, test_dataloader, _ = kolossos.initialize(
        model,
        optimizer,
        criterion,
        train_dataloader,
        test_dataloader,
    )
    return engine, train_dataloader, test_dataloader, lr_scheduler


def train_with_engine(args: argparse.Namespace, logger: Any) -> None:
    """Step 5: the engine loop."""
    engine, train_dataloader, test_dataloader, lr_scheduler = build_components(args)
    for epoch in range(gpc.config.NUM_EPOCHS):
        # execute a training iteration
        engine.train()
        for img, label in train_dataloader:
            img = img.to(get_current_device())
            label = label.to(get_current_device())

            # set gradients to zero
            engine.zero_grad()

            # run forward pass
            output = engine(img)

            # compute loss value and run backward pass
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)

            # update parameters
            engine.step()

        # update learning rate
        lr_scheduler.step()

        # execute a testing iteration
        engine.eval()
        correct = 0
        total = 0
        for img, label in test_dataloader:
            img = img.to(get_current_device())
            label = label.to(get_current_device())

            # run prediction without back-propagation
            with torch.no_grad():
                output = engine(img)
                test_loss = engine.criterion(output, label)

            # compute the number of correct prediction
            pred = torch.argmax(output, dim=-1)
            correct += torch.sum(pred == label)
            total += img.size(0)

        logger.info(
            f"Epoch {epoch} - train loss: {train_loss:.5}, test loss: {test_loss:.5}, "
            f"acc: {correct / total:.5}, lr: {lr_scheduler.get_last_lr()[0]:.5g}",
            ranks=[0],
        )


def train_with_trainer(args: argparse.Namespace, logger: Any) -> None:
    """Step 6: ``Trainer.fit`` with the tutorial's hooks."""
    engine, train_dataloader, test_dataloader, lr_scheduler = build_components(args)

    # create a trainer object
    trainer = Trainer(engine=engine, logger=logger)

    # define the hooks to attach to the trainer
    hook_list = [
        hooks.LossHook(),
        hooks.LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True),
        hooks.AccuracyHook(accuracy_func=Accuracy()),
        hooks.LogMetricByEpochHook(logger),
        hooks.LogMemoryByEpochHook(logger),
    ]

    # start training
    # run testing every 1 epoch
    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=gpc.config.NUM_EPOCHS,
        test_dataloader=test_dataloader,
        test_interval=1,
        hooks=hook_list,
        display_progress=True,
    )


def main() -> int:
    """Launch (step 2), then train with the engine and/or the trainer."""
    args = parse_args()
    # ./config.py refers to the config file of step 1
    kolossos.launch_from_torch(config=args.config)

    # build logger
    logger = get_dist_logger()
    if args.mode in ("engine", "both"):
        logger.info("Training with the engine", ranks=[0])
        train_with_engine(args, logger)
    if args.mode in ("trainer", "both"):
        logger.info("Training with the trainer", ranks=[0])
        train_with_trainer(args, logger)
    logger.info("Training finished", ranks=[0])
    gpc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
