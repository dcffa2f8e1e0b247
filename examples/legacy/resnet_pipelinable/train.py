"""ResNet-50 built inside ``PipelinableContext``, split into 2 pipeline stages by its execution
sequence, trained with the Trainer: the "Train ResNet with pipeline" part of the pipeline
parallelism page (CHECKLIST §20.15), at a tiny size.

Run::

    kolossos run --nproc_per_node 2 examples/legacy/resnet_pipelinable/train.py

Changes from the tutorial: imports from ``kolossos``; torchvision's ``resnet50`` became
``kolossos.models``' ResNet with ResNet-50's ``Bottleneck`` blocks, shrunk by ``BLOCKS`` and
``WIDTH`` below (ResNet-50: (3, 4, 6, 3) blocks, width 64, 1000 classes) with the 32x32 CIFAR stem;
titans' ``build_cifar(BATCH_SIZE, root, padding=4, crop=32, resize=32)`` is defined here on
``kolossos.datasets.CIFAR10`` (real CIFAR-10 from ``$DATA`` when its files are there, otherwise
deterministic synthetic data of the same shape, ``--train_size``/``--test_size`` samples) with
the same crop/flip/normalise; ``BATCH_SIZE`` is 16 (the tutorial: 64). The script exits with 1
unless every logged loss is finite.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn as nn

import kolossos
import kolossos.nn as col_nn
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.logging import disable_existing_loggers, get_dist_logger
from kolossos.models.resnet import Bottleneck, ResNet
from kolossos.pipeline.pipelinable import PipelinableContext
from kolossos.trainer import Trainer, hooks
from kolossos.utils import MultiTimer, get_dataloader

BLOCKS, WIDTH = (1, 1, 1, 1), 8  # ResNet-50: (3, 4, 6, 3), 64


def resnet50():
    """ResNet-50's structure (Bottleneck blocks, conv1 ... layer4, avgpool, fc), tiny."""
    return ResNet(Bottleneck, BLOCKS, num_classes=10, cifar_stem=True, base_width=WIDTH)


def build_cifar(batch_size, root, padding=4, crop=32, resize=32):
    """titans' helper: RandomCrop(crop, padding) + flip + normalise for training, normalise for
    testing (CIFAR-10's 32x32 images need no resize)."""
    assert crop == resize == 32, "this stand-in keeps CIFAR-10's 32x32 images"
    train = CIFAR10(root=root, train=True, synthetic_size=ARGS.train_size,
                    transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD, crop_padding=padding,
                                             flip=True))  # fmt: skip
    test = CIFAR10(root=root, train=False, synthetic_size=ARGS.test_size,
                   transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD))  # fmt: skip
    train_dataloader = get_dataloader(dataset=train, shuffle=True, batch_size=batch_size,
                                      drop_last=True)  # fmt: skip
    test_dataloader = get_dataloader(dataset=test, batch_size=batch_size, drop_last=True)
    return train_dataloader, test_dataloader


class FiniteLossCheck(hooks.BaseHook):
    """Records each step's loss on the last pipeline stage (this example's claim: it trains)."""

    def __init__(self) -> None:
        super().__init__(priority=10)
        self.losses = []

    def after_train_iter(self, trainer, output, label, loss):
        if loss is not None:
            self.losses.append(float(loss))


def main():
    # Define some config
    BATCH_SIZE = 16
    NUM_EPOCHS = 2
    NUM_CHUNKS = 1
    CONFIG = dict(NUM_MICRO_BATCHES=4, parallel=dict(pipeline=2))

    # Train
    disable_existing_loggers()
    parser = kolossos.get_default_parser()
    args = parser.parse_args(REST)
    kolossos.launch_from_torch(backend=args.backend, config=CONFIG)
    logger = get_dist_logger()
    pipelinable = PipelinableContext()

    # build model
    with pipelinable:
        model = resnet50()

    exec_seq = [
        'conv1', 'bn1', 'relu', 'maxpool', 'layer1', 'layer2', 'layer3', 'layer4', 'avgpool',
        (lambda x: torch.flatten(x, 1), "behind"), 'fc'
    ]  # fmt: skip
    pipelinable.to_layer_list(exec_seq)

    model = pipelinable.partition(
        NUM_CHUNKS, gpc.pipeline_parallel_size, gpc.get_local_rank(ParallelMode.PIPELINE)
    )
    logger.info(
        f"pipeline rank {gpc.get_local_rank(ParallelMode.PIPELINE)} holds {model.layer_names}"
    )

    # build criterion
    criterion = nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # build dataloader
    root = os.environ.get("DATA", "./data")
    train_dataloader, test_dataloader = build_cifar(BATCH_SIZE, root, padding=4, crop=32, resize=32)

    lr_scheduler = col_nn.lr_scheduler.LinearWarmupLR(optimizer, NUM_EPOCHS, warmup_steps=1)
    engine, train_dataloader, test_dataloader, lr_scheduler = kolossos.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader, lr_scheduler
    )
    timer = MultiTimer()

    trainer = Trainer(engine=engine, timer=timer, logger=logger)

    check = FiniteLossCheck()
    hook_list = [
        hooks.LossHook(),
        hooks.AccuracyHook(col_nn.metric.Accuracy()),
        hooks.LogMetricByEpochHook(logger),
        hooks.LRSchedulerHook(lr_scheduler, by_epoch=True),
        check,
    ]

    trainer.fit(train_dataloader=train_dataloader,
                epochs=NUM_EPOCHS,
                test_dataloader=test_dataloader,
                test_interval=1,
                hooks=hook_list,
                display_progress=True)  # fmt: skip
    return check.losses


def _parse_sizes() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--train_size", type=int, default=64, help="synthetic train samples")
    parser.add_argument("--test_size", type=int, default=32, help="synthetic test samples")
    return parser.parse_known_args()


if __name__ == "__main__":
    ARGS, REST = _parse_sizes()
    losses = main()
    if losses and not all(math.isfinite(x) for x in losses):
        print(f"non-finite loss: {losses}", file=sys.stderr)
        sys.exit(1)
    if losses:  # the last stage
        print(f"last stage trained {len(losses)} steps, losses {losses[0]:.4f} -> {losses[-1]:.4f}")
