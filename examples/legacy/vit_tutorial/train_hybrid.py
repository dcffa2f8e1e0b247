"""ViT on CIFAR-10 with pipeline parallelism, or 1D tensor + pipeline parallelism, and the
engine loop: the second and third parts of "Step By Step: Accelerate ViT Training With
Colossal-AI" (``hybrid_parallel/train_with_cifar10.py``).

Run (2 processes: pipeline 2; 4 processes: pipeline 2 x 1D tensor 2)::

    kolossos run --nproc_per_node 2 examples/legacy/vit_tutorial/train_hybrid.py \\
        --config examples/legacy/vit_tutorial/configs/config_pipeline_parallel.py
    kolossos run --nproc_per_node 4 examples/legacy/vit_tutorial/train_hybrid.py \\
        --config examples/legacy/vit_tutorial/configs/config_hybrid_parallel.py

Changes from the tutorial: imports from ``kolossos`` (``model_zoo.vit.vit`` is
``kolossos.model_zoo.vit.vit``); ``build_cifar`` (see ``data.py``) gets the batch size the
tutorial forgets to pass; the data iterator is made at the start of every epoch (the tutorial
makes one before the loop, which runs dry after the first epoch); tqdm is used when installed;
each epoch logs the last pipeline stage's mean loss, and the script exits with 1 unless those
losses are finite; ``--config`` defaults to ``configs/config_pipeline_parallel.py``.
"""

import math
import os
import sys
from pathlib import Path

import torch

import kolossos
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.legacy.engine.schedule import (  # noqa: F401  (imported by the tutorial)
    InterleavedPipelineSchedule,
    PipelineSchedule,
)
from kolossos.logging import get_dist_logger
from kolossos.model_zoo.vit.vit import _create_vit_model
from kolossos.nn import CrossEntropyLoss
from kolossos.nn.lr_scheduler import CosineAnnealingWarmupLR
from kolossos.utils import MultiTimer, get_dataloader, is_using_pp  # noqa: F401

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data import build_cifar  # noqa: E402
from model.vit import build_pipeline_vit  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # kolossos: tqdm is optional
    tqdm = None

CONFIG = HERE / "configs" / "config_pipeline_parallel.py"


def main():
    # initialize distributed setting
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(CONFIG))
    args = parser.parse_args()

    # launch from torch
    kolossos.launch_from_torch(config=args.config)

    # get logger
    logger = get_dist_logger()
    logger.info("initialized distributed environment", ranks=[0])

    if hasattr(gpc.config, "LOG_PATH"):
        if gpc.get_global_rank() == 0:
            log_path = gpc.config.LOG_PATH
            if not os.path.exists(log_path):
                os.mkdir(log_path)
        logger.log_to_file(log_path)

    use_pipeline = is_using_pp()

    # create model
    model_kwargs = dict(
        img_size=gpc.config.IMG_SIZE,
        patch_size=gpc.config.PATCH_SIZE,
        dim=gpc.config.HIDDEN_SIZE,
        depth=gpc.config.DEPTH,
        num_heads=gpc.config.NUM_HEADS,
        mlp_ratio=gpc.config.MLP_RATIO,
        num_classes=gpc.config.NUM_CLASSES,
        init_method="jax",
        checkpoint=gpc.config.CHECKPOINT,
    )

    if use_pipeline:
        model = build_pipeline_vit(num_layers=model_kwargs["depth"], num_chunks=1, **model_kwargs)
    else:
        model = _create_vit_model(**model_kwargs)

    # count number of parameters
    total_numel = 0
    for p in model.parameters():
        total_numel += p.numel()
    if not gpc.is_initialized(ParallelMode.PIPELINE):
        pipeline_stage = 0
    else:
        pipeline_stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    logger.info(f"number of parameters: {total_numel} on pipeline stage {pipeline_stage}")

    # create dataloaders
    train_dataloader, test_dataloader = build_cifar(gpc.config.BATCH_SIZE)

    # create loss function
    criterion = CrossEntropyLoss(label_smoothing=0.1)

    # create optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=gpc.config.LEARNING_RATE, weight_decay=gpc.config.WEIGHT_DECAY
    )

    # create lr scheduler
    lr_scheduler = CosineAnnealingWarmupLR(
        optimizer=optimizer,
        total_steps=gpc.config.NUM_EPOCHS,
        warmup_steps=gpc.config.WARMUP_EPOCHS,
    )

    # initialize
    engine, train_dataloader, test_dataloader, _ = kolossos.initialize(
        model=model,
        optimizer=optimizer,
        criterion=criterion,
        train_dataloader=train_dataloader,
        test_dataloader=test_dataloader,
    )

    logger.info("Engine is built", ranks=[0])

    last_stage = not use_pipeline or gpc.is_last_rank(ParallelMode.PIPELINE)
    epoch_losses = []
    for epoch in range(gpc.config.NUM_EPOCHS):
        data_iter = iter(train_dataloader)  # kolossos: a fresh iterator every epoch
        # training
        engine.train()

        if gpc.get_global_rank() == 0 and tqdm is not None:
            description = f"Epoch {epoch} / {gpc.config.NUM_EPOCHS}"
            progress = tqdm(range(len(train_dataloader)), desc=description)
        else:
            progress = range(len(train_dataloader))
        losses = []
        for _ in progress:
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(data_iter, return_output_label=False)
            engine.step()
            if last_stage:
                losses.append(float(loss))
        lr_scheduler.step()
        if last_stage:
            epoch_losses.append(sum(losses) / len(losses))
            print(
                f"[rank {gpc.get_global_rank()}] Epoch {epoch} - train loss: "
                f"{epoch_losses[-1]:.4f}, lr: {lr_scheduler.get_last_lr()[0]:.6f}",
                flush=True,
            )
    return 0 if all(math.isfinite(v) for v in epoch_losses) else 1


if __name__ == "__main__":
    sys.exit(main())
