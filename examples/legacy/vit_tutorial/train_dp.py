"""ViT on CIFAR-10 with data parallelism and the Trainer: the first part of "Step By Step:
Accelerate ViT Training With Colossal-AI" (``data_parallel/train_with_cifar10.py``).

Run (``$DATA``: where CIFAR-10 is, or is downloaded to with ``DOWNLOAD_CIFAR=1``)::

    kolossos run --nproc_per_node 2 examples/legacy/vit_tutorial/train_dp.py \\
        --config examples/legacy/vit_tutorial/configs/config_data_parallel.py

Changes from the tutorial: imports from ``kolossos``; timm's ``vit_base_patch16_224`` (timm is
not a dependency) became ``kolossos.models.VisionTransformer`` sized by the config
(``IMG_SIZE``, ``PATCH_SIZE``, ``HIDDEN_SIZE``, ``DEPTH``, ``NUM_HEADS``); ``build_cifar`` is the
tutorial's function on ``kolossos.legacy.data.build_cifar`` (see ``data.py``: 224 becomes
``IMG_SIZE``, a synthetic stand-in without the data set); ``MixupAccuracy`` is imported (the
tutorial uses it without an import); ``TensorboardHook`` is skipped with a warning when
TensorBoard is not installed; ``--config`` defaults to ``configs/config_data_parallel.py``. The
script exits with 1 unless every epoch's loss is finite and each epoch left a checkpoint.
"""

import math
import os
import sys
from pathlib import Path

import torch

import kolossos
from kolossos.context import ParallelMode  # noqa: F401  (imported by the tutorial)
from kolossos.core import global_context as gpc
from kolossos.legacy.nn.metric import Accuracy, MixupAccuracy  # noqa: F401
from kolossos.legacy.trainer import Trainer, hooks
from kolossos.logging import disable_existing_loggers, get_dist_logger
from kolossos.models import VisionTransformer
from kolossos.nn.lr_scheduler import LinearWarmupLR

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import build_cifar

CONFIG = Path(__file__).resolve().parent / "configs" / "config_data_parallel.py"


def vit_base_patch16_224(drop_rate, num_classes):
    """Stand-in for timm's model, sized by the config."""
    c = gpc.config
    return VisionTransformer(
        image_size=c.IMG_SIZE, patch_size=c.PATCH_SIZE, num_classes=num_classes,
        dim=c.HIDDEN_SIZE, depth=c.DEPTH, heads=c.NUM_HEADS, dropout=drop_rate,
    )  # fmt: skip


def main():
    # initialize distributed setting
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(CONFIG))
    args = parser.parse_args()
    kolossos.launch_from_torch(config=args.config)

    disable_existing_loggers()
    logger = get_dist_logger()

    # access parameters
    print(gpc.config.BATCH_SIZE)

    # build model
    model = vit_base_patch16_224(drop_rate=0.1, num_classes=gpc.config.NUM_CLASSES)

    # build dataloader
    train_dataloader, test_dataloader = build_cifar(gpc.config.BATCH_SIZE)

    # build optimizer
    optimizer = kolossos.nn.Lamb(model.parameters(), lr=1.8e-2, weight_decay=0.1)

    # build loss
    criterion = torch.nn.CrossEntropyLoss()

    # lr_scheduler
    lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=50, total_steps=gpc.config.NUM_EPOCHS)

    engine, train_dataloader, test_dataloader, _ = kolossos.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )

    # build trainer
    trainer = Trainer(engine=engine, logger=logger)

    # build hooks
    hook_list = [
        hooks.LossHook(),
        hooks.AccuracyHook(accuracy_func=MixupAccuracy()),
        hooks.LogMetricByEpochHook(logger),
        hooks.LRSchedulerHook(lr_scheduler, by_epoch=True),
        # comment if you do not need to use the hooks below
        hooks.SaveCheckpointHook(interval=1, checkpoint_dir="./ckpt"),
    ]
    try:
        hook_list.append(hooks.TensorboardHook(log_dir="./tb_logs", ranks=[0]))
    except ImportError as error:  # kolossos: TensorBoard is optional
        logger.warning(f"TensorboardHook skipped: {error}", ranks=[0])

    # start training
    trainer.fit(
        train_dataloader=train_dataloader,
        test_dataloader=test_dataloader,
        epochs=gpc.config.NUM_EPOCHS,
        hooks=hook_list,
        display_progress=True,
        test_interval=1,
    )

    # kolossos: what the page promises
    saved = [Path("./ckpt") / f"epoch{e}.pt" for e in range(gpc.config.NUM_EPOCHS)]
    loss = trainer.states["metrics"]["train"]["Loss"].get_accumulated_value()
    ok = math.isfinite(float(loss)) and all(p.is_file() for p in saved)
    logger.info(f"checkpoints: {[str(p) for p in saved]}, last train loss {float(loss):.4f}", [0])
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
