"""ViT-L/16 as an ``nn.Sequential``, split into 2 pipeline stages by ``build_pipeline_model``:
the "Train ViT Using Pipeline Parallelism" tutorial (CHECKLIST §20.14), at a tiny size.

Run::

    kolossos run --nproc_per_node 2 examples/legacy/vit_pipeline_sequential/train.py

Changes from the tutorial: imports from ``kolossos``; timm's ``vision_transformer`` is used when
timm is installed, else the stand-in ``timm_vit.py`` next to this script (same names and
signatures); torchvision's ``CIFAR10`` and transforms became ``kolossos.datasets.CIFAR10`` (real
CIFAR-10 from ``$DATA`` when its files are there, otherwise deterministic synthetic data of the
same shape, ``--train_size``/``--test_size`` samples) with normalisation only (no 224 crop or
AutoAugment: the images stay 32x32); the sizes are tiny (``EMBED_DIM``, ``DEPTH``, ``NUM_HEADS``,
``IMG_SIZE``, ``PATCH_SIZE`` below; the tutorial's ViT-L/16 is 1024 / 24 / 16 at 224 / 16, 1000
classes) and ``NUM_EPOCHS`` is 2 (the tutorial: 60). The script exits with 1 unless every logged
loss is finite.
"""

import argparse
import math
import os
import sys
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

import kolossos
import kolossos.nn as col_nn
from kolossos.builder import build_pipeline_model
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.engine.schedule import InterleavedPipelineSchedule, PipelineSchedule  # noqa: F401
from kolossos.logging import disable_existing_loggers, get_dist_logger
from kolossos.trainer import Trainer, hooks
from kolossos.utils import MultiTimer, get_dataloader

try:
    from timm.models import vision_transformer as vit
except ImportError:  # the stand-in next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import timm_vit as vit  # type: ignore[no-redef]

# tiny sizes (the tutorial's ViT-L/16: 1024, 24, 16 on 224x224 images, 1000 classes)
EMBED_DIM, DEPTH, NUM_HEADS = 32, 4, 4
IMG_SIZE, PATCH_SIZE, NUM_CLASSES = 32, 8, 10


class ViTEmbedding(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768,
                 embed_layer=vit.PatchEmbed, drop_rate=0., distilled=False):  # fmt: skip
        super().__init__()
        self.embed_dim = embed_dim  # num_features for consistency with other models
        self.num_tokens = 2 if distilled else 1
        self.patch_embed = embed_layer(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim
        )
        num_patches = self.patch_embed.num_patches

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + self.num_tokens, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)
        self.init_weights()

    def forward(self, x):
        x = self.patch_embed(x)
        cls_token = self.cls_token.expand(
            x.shape[0], -1, -1
        )  # stole cls_tokens impl from Phil Wang, thanks
        if self.dist_token is None:
            x = torch.cat((cls_token, x), dim=1)
        else:
            x = torch.cat((cls_token, self.dist_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return x

    def init_weights(self):
        vit.trunc_normal_(self.pos_embed, std=0.02)
        if self.dist_token is not None:
            vit.trunc_normal_(self.dist_token, std=0.02)
        vit.trunc_normal_(self.cls_token, std=0.02)
        self.apply(vit._init_vit_weights)


class ViTHead(nn.Module):
    def __init__(self, embed_dim=768, num_classes=1000, norm_layer=None, distilled=False,
                 representation_size=None):  # fmt: skip
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        self.norm = norm_layer(embed_dim)
        self.num_classes = num_classes
        self.distilled = distilled
        self.num_features = embed_dim
        # Representation layer
        if representation_size and not distilled:
            self.num_features = representation_size
            self.pre_logits = nn.Sequential(OrderedDict([
                ('fc', nn.Linear(embed_dim, representation_size)),
                ('act', nn.Tanh())
            ]))  # fmt: skip
        else:
            self.pre_logits = nn.Identity()
        # Classifier head(s)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = None
        if distilled:
            self.head_dist = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def forward(self, x):
        x = self.norm(x)
        if self.distilled:
            x, x_dist = self.head(x[:, 0]), self.head_dist(x[:, 1])
            if self.training and not torch.jit.is_scripting():
                # during inference, return the average of both classifier predictions
                return x, x_dist
            else:
                return (x + x_dist) / 2
        else:
            x = self.pre_logits(x[:, 0])
            x = self.head(x)
        return x

    def init_weights(self):
        self.apply(vit._init_vit_weights)


def sequential_vit(img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=768,
                   depth=12, num_heads=12, mlp_ratio=4., qkv_bias=True, representation_size=None,
                   distilled=False, drop_rate=0., attn_drop_rate=0., drop_path_rate=0.,
                   embed_layer=vit.PatchEmbed, norm_layer=None, act_layer=None):  # fmt: skip
    norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
    act_layer = act_layer or nn.GELU
    embedding = ViTEmbedding(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                             embed_dim=embed_dim, embed_layer=embed_layer, drop_rate=drop_rate,
                             distilled=distilled)  # fmt: skip
    dpr = [
        x.item() for x in torch.linspace(0, drop_path_rate, depth)
    ]  # stochastic depth decay rule
    blocks = [vit.Block(
        dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
        attn_drop=attn_drop_rate, drop_path=dpr[i], norm_layer=norm_layer, act_layer=act_layer)
        for i in range(depth)]  # fmt: skip
    for block in blocks:
        block.apply(vit._init_vit_weights)
    head = ViTHead(embed_dim=embed_dim, num_classes=num_classes, norm_layer=norm_layer,
                   distilled=distilled, representation_size=representation_size)  # fmt: skip
    return nn.Sequential(embedding, *blocks, head)


def vit_large_patch16_224(**kwargs):
    model_kwargs = dict(embed_dim=EMBED_DIM, depth=DEPTH, num_heads=NUM_HEADS, **kwargs)
    return sequential_vit(**model_kwargs)


def build_cifar(batch_size):
    # the tutorial: RandomCrop(224, pad_if_needed=True), AutoAugment(CIFAR10), ToTensor,
    # Normalize; Resize(224) for the test set. Here: 32x32 images, ToTensor + Normalize.
    transform_train = ImageTransform(CIFAR10_MEAN, CIFAR10_STD)
    transform_test = ImageTransform(CIFAR10_MEAN, CIFAR10_STD)
    root = os.environ.get("DATA", "./data")
    train_dataset = CIFAR10(root=root, train=True, transform=transform_train,
                            synthetic_size=ARGS.train_size)  # fmt: skip
    test_dataset = CIFAR10(root=root, train=False, transform=transform_test,
                           synthetic_size=ARGS.test_size)  # fmt: skip
    train_dataloader = get_dataloader(dataset=train_dataset, shuffle=True, batch_size=batch_size,
                                      pin_memory=True, drop_last=True)  # fmt: skip
    test_dataloader = get_dataloader(dataset=test_dataset, batch_size=batch_size, pin_memory=True,
                                     drop_last=True)  # fmt: skip
    return train_dataloader, test_dataloader


BATCH_SIZE = 16
NUM_EPOCHS = 2
NUM_CHUNKS = 1
CONFIG = dict(NUM_MICRO_BATCHES=4, parallel=dict(pipeline=2))


class FiniteLossCheck(hooks.BaseHook):
    """Records each step's loss on the last pipeline stage (this example's claim: it trains)."""

    def __init__(self) -> None:
        super().__init__(priority=10)
        self.losses = []

    def after_train_iter(self, trainer, output, label, loss):
        if loss is not None:
            self.losses.append(float(loss))


def train():
    disable_existing_loggers()
    parser = kolossos.get_default_parser()
    args = parser.parse_args(REST)
    kolossos.launch_from_torch(backend=args.backend, config=CONFIG)
    logger = get_dist_logger()

    # build model
    model = vit_large_patch16_224(img_size=IMG_SIZE, patch_size=PATCH_SIZE, num_classes=NUM_CLASSES)
    model = build_pipeline_model(model, num_chunks=NUM_CHUNKS, verbose=True)

    # build criterion
    criterion = nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, weight_decay=0)

    # build dataloader
    train_dataloader, test_dataloader = build_cifar(BATCH_SIZE)

    engine, train_dataloader, test_dataloader, _ = kolossos.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )
    timer = MultiTimer()

    trainer = Trainer(engine=engine, timer=timer, logger=logger)

    check = FiniteLossCheck()
    hook_list = [
        hooks.LossHook(),
        hooks.AccuracyHook(col_nn.metric.Accuracy()),
        hooks.LogMetricByEpochHook(logger),
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
    losses = train()
    if losses and not all(math.isfinite(x) for x in losses):
        print(f"non-finite loss: {losses}", file=sys.stderr)
        sys.exit(1)
    if losses:  # the last stage
        print(f"last stage trained {len(losses)} steps, losses {losses[0]:.4f} -> {losses[-1]:.4f}")
