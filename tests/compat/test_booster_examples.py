"""The Booster tutorials (CHECKLIST §20.1–20.4) as tests on 2 ranks.

Each rank function is the tutorial's code rewritten only by import (``colossalai`` → ``kolossos``),
model and data source (``kolossos.models``, ``kolossos.datasets`` with synthetic CIFAR-10) and
device (``.cuda()`` → ``.to(get_current_device())``), at tiny sizes; the lines marked ``# doc``
are the tutorial's. The checks after the tutorial code are what the docs promise.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim import SGD

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.cluster.dist_coordinator import priority_execution
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.logging import get_dist_logger
from kolossos.mixed_precision import FP16TorchMixedPrecision
from kolossos.models import BasicBlock, ResNet, VisionTransformer, resnet18
from kolossos.nn.lr_scheduler import CosineAnnealingLR, LinearWarmupLR
from kolossos.testing import spawn
from kolossos.utils import get_current_device

WORLD_SIZE = 2
MiB = 1024**2


def _cifar10(root: str, normalize: tuple[tuple[float, ...], tuple[float, ...]]) -> CIFAR10:
    """The tutorials' ``CIFAR10(root, download=True, transform=Compose([...]))``: crop, flip,
    normalise; ``root`` has no data, so a small synthetic stand-in is used."""
    transform = ImageTransform(*normalize, crop_padding=4, flip=True)
    return CIFAR10(root=Path(root), download=False, transform=transform, synthetic_size=64)


def _tiny_resnet() -> ResNet:
    """ResNet-34's block type at (1, 1, 1, 1) blocks of width 8: fp16 is emulated on a CPU, where
    a real ResNet-34 step takes seconds."""
    return ResNet(BasicBlock, (1, 1, 1, 1), num_classes=10, base_width=8)


# --- §20.1 Booster API: boost, step, sharded safetensors save, load into a fresh model ------------
def _booster_api(rank: int, world_size: int, port: int, save_dir: str) -> list[str]:
    kolossos.launch(
        config=dict(), rank=rank, world_size=world_size, port=port, host="localhost"
    )  # doc
    plugin = TorchDDPPlugin()  # doc
    booster = Booster(plugin=plugin)  # doc
    model = resnet18()  # doc
    criterion = lambda x: x.mean()  # noqa: E731  (doc)
    optimizer = SGD((model.parameters()), lr=0.001)  # doc
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)  # doc
    model, optimizer, criterion, _, scheduler = booster.boost(
        model, optimizer, criterion, lr_scheduler=scheduler
    )  # doc

    x = torch.randn(4, 3, 32, 32)  # doc: (4, 3, 224, 224)
    x = x.to(get_current_device())  # doc: x.to('cuda')
    output = model(x)  # doc
    loss = criterion(output)  # doc
    booster.backward(loss, optimizer)  # doc
    optimizer.clip_grad_by_norm(1.0)  # doc
    optimizer.step()  # doc
    scheduler.step()  # doc

    use_safetensors = True  # undefined in the doc
    save_path = os.path.join(save_dir, "model")  # doc: "./model"
    booster.save_model(model, save_path, True, True, "", 10, use_safetensors=use_safetensors)

    new_model = resnet18()  # doc
    saved = model.unwrap().state_dict()
    assert not torch.equal(new_model.conv1.weight, saved["conv1.weight"])
    booster.load_model(new_model, save_path)  # doc

    loaded = new_model.state_dict()
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    return sorted(os.listdir(save_path))


def test_booster_api_sharded_safetensors_roundtrip(tmp_path: Path) -> None:
    """§20.1: loaded weights equal the saved ones (checked on every rank), every shard is at most
    10 MB, and the directory is a Hugging Face sharded checkpoint that plain safetensors reads."""
    from safetensors.torch import load_file

    listings = spawn(_booster_api, WORLD_SIZE, save_dir=str(tmp_path))
    assert listings[0] == listings[1]
    path = tmp_path / "model"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "a 45 MB model in 10 MB shards takes several files"
    assert listings[0] == sorted(["model.safetensors.index.json", *shards])
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        assert (path / shard).stat().st_size <= 10 * MiB, shard
        tensors.update(load_file(str(path / shard)))
    assert set(tensors) == set(index["weight_map"]) == set(resnet18().state_dict())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total


# --- §20.2 gradient accumulation with booster.no_sync ---------------------------------------
GRADIENT_ACCUMULATION = 4


def _gradient_accumulation(rank: int, world_size: int, port: int, root: str) -> list[str]:
    kolossos.launch_from_torch(config=dict())  # doc
    BATCH_SIZE = 4  # doc: 128
    model = resnet18(num_classes=10)  # doc
    with priority_execution():  # doc
        train_dataset = _cifar10(root, (CIFAR10_MEAN, CIFAR10_STD))  # doc: CIFAR10(...)
    criterion = torch.nn.CrossEntropyLoss()  # doc
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)  # doc

    plugin = TorchDDPPlugin()  # doc
    booster = Booster(plugin=plugin)  # doc
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
    )  # doc
    model, optimizer, criterion, train_dataloader, _ = booster.boost(
        model=model, optimizer=optimizer, criterion=criterion, dataloader=train_dataloader
    )  # doc

    param_by_iter = [str(next(model.parameters()).flatten()[0].item())]  # the initial value
    optimizer.zero_grad()  # doc
    for idx, (img, label) in enumerate(train_dataloader):  # doc
        sync_context = booster.no_sync(model)  # doc
        img = img.to(get_current_device())  # doc: img.cuda()
        label = label.to(get_current_device())  # doc: label.cuda()
        if (idx + 1) % GRADIENT_ACCUMULATION != 0:  # doc: idx % (GRADIENT_ACCUMULATION - 1) != 0
            with sync_context:  # doc
                output = model(img)  # doc
                train_loss = criterion(output, label)  # doc
                booster.backward(train_loss, optimizer)  # doc
        else:
            output = model(img)  # doc
            train_loss = criterion(output, label)  # doc
            booster.backward(train_loss, optimizer)  # doc
            optimizer.step()  # doc
            optimizer.zero_grad()  # doc

        ele_1st = next(model.parameters()).flatten()[0]  # doc
        param_by_iter.append(str(ele_1st.item()))  # doc

        if idx + 1 == GRADIENT_ACCUMULATION:  # doc: idx != 0 and idx % (GA - 1) == 0
            break  # doc
    return param_by_iter


def test_gradient_accumulation_updates_only_at_the_fourth_iteration(tmp_path: Path) -> None:
    """§20.2: the first parameter element is unchanged at iterations 0..2, changed at 3, and the
    same on both ranks (the accumulated gradients were synchronised at the step)."""
    results = spawn(_gradient_accumulation, WORLD_SIZE, root=str(tmp_path / "data"))
    assert results[0] == results[1]
    initial, *param_by_iter = results[0]
    assert len(param_by_iter) == GRADIENT_ACCUMULATION
    assert param_by_iter[:3] == [initial] * 3
    assert param_by_iter[3] != initial


def test_docs_modulo_would_step_at_iteration_zero() -> None:
    """§22.3: the tutorial's condition ``idx % (GRADIENT_ACCUMULATION - 1) != 0`` steps at
    iterations 0, 3, 6 (not every 4th), which is why the tests and examples use
    ``(idx + 1) % GRADIENT_ACCUMULATION == 0``."""
    docs = [idx for idx in range(8) if idx % (GRADIENT_ACCUMULATION - 1) == 0]
    fixed = [idx for idx in range(8) if (idx + 1) % GRADIENT_ACCUMULATION == 0]
    assert docs == [0, 3, 6]
    assert fixed == [3, 7]


# --- §20.3 gradient clipping with fp16 ----------------------------------------------------------
# The doc runs 4 iterations. The fp16 loss scale starts at 2**16 and halves on each overflow; on a
# CPU (fp16 emulated, fp16 accumulation in the convolutions' backward) the first 3-4 steps can
# overflow, so 8 iterations make sure some steps are taken and clipped.
CLIPPING_ITERATIONS = 8


def _gradient_clipping(rank: int, world_size: int, port: int, root: str) -> list[dict[str, Any]]:
    kolossos.launch_from_torch(config=dict())  # doc
    logger = get_dist_logger()  # doc
    NUM_EPOCHS = 200  # doc
    BATCH_SIZE = 4  # doc: 128
    GRADIENT_CLIPPING = 0.1  # doc
    model = _tiny_resnet()  # doc: resnet34(num_classes=10)
    train_dataset = _cifar10(root, (CIFAR10_MEAN, CIFAR10_STD))  # doc: CIFAR10(...)
    criterion = torch.nn.CrossEntropyLoss()  # doc
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)  # doc
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=NUM_EPOCHS)  # doc

    plugin = TorchDDPPlugin()  # doc
    booster = Booster(mixed_precision="fp16", plugin=plugin)  # doc
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
    )  # doc
    model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, train_dataloader, lr_scheduler
    )  # doc

    records = []
    model.train()  # doc
    for idx, (img, label) in enumerate(train_dataloader):  # doc
        img = img.to(get_current_device())  # doc: img.cuda()
        label = label.to(get_current_device())  # doc: label.cuda()

        model.zero_grad()  # doc
        output = model(img)  # doc
        train_loss = criterion(output, label)  # doc
        booster.backward(train_loss, optimizer)  # doc
        params = [p for p in model.parameters() if p.grad is not None]
        scaled_norm = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
        loss_scale = optimizer.loss_scale
        before = [p.detach().clone() for p in params]
        norm = optimizer.clip_grad_by_norm(max_norm=GRADIENT_CLIPPING)  # doc (returned norm kept)
        clipped_norm = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
        optimizer.step()  # doc
        lr_scheduler.step()  # doc
        moved = any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))

        ele_1st = next(model.parameters()).flatten()[0]  # doc
        logger.info(f"iteration {idx}, loss: {train_loss}, 1st element: {ele_1st.item()}")  # doc
        records.append(
            dict(norm=norm.item(), scaled_norm=scaled_norm, loss_scale=loss_scale,
                 clipped_norm=clipped_norm, moved=moved, loss=train_loss.item())
        )  # fmt: skip
        if idx == CLIPPING_ITERATIONS - 1:  # doc: `if idx == 3: break` (4 iterations)
            break  # doc
    return records


def test_gradient_clipping_with_fp16_bounds_the_norm(tmp_path: Path) -> None:
    """§20.3: with fp16 and ``clip_grad_by_norm(max_norm=0.1)``, every step that is taken has a
    gradient norm <= 0.1 after clipping (recomputed); the returned norm is the unscaled norm
    before clipping; a step whose fp16 gradients overflowed returns inf and is skipped."""
    max_norm = 0.1
    results = spawn(_gradient_clipping, WORLD_SIZE, root=str(tmp_path / "data"))
    records = results[0]
    assert len(records) == CLIPPING_ITERATIONS
    for mine, other in zip(records, results[1], strict=True):  # gradients are synchronised
        assert (mine["norm"], mine["moved"]) == (other["norm"], other["moved"])
    taken = [r for r in records if math.isfinite(r["norm"])]
    assert taken, f"every fp16 step overflowed: {records}"
    for r in records:
        assert math.isfinite(r["loss"])
        if not math.isfinite(r["norm"]):
            assert not r["moved"], "an overflowed step must be skipped"
            continue
        assert r["moved"]
        assert r["norm"] == pytest.approx(r["scaled_norm"] / r["loss_scale"], rel=1e-4)
        assert r["norm"] > max_norm  # so clipping really happened
        assert r["clipped_norm"] <= max_norm * (1 + 1e-5)
        assert r["clipped_norm"] == pytest.approx(max_norm, rel=1e-4)


# --- §20.4 AMP with the Booster: 'fp16' string and FP16TorchMixedPrecision object -------------
def _amp_training(rank: int, world_size: int, port: int, root: str, use_object: bool) -> list[Any]:
    kolossos.launch_from_torch(config=dict())  # doc
    NUM_EPOCHS = 2  # doc
    BATCH_SIZE = 4  # doc: 128
    model = VisionTransformer(32, 8, 10, dim=192, depth=2, heads=3, dropout=0.1)  # doc: timm ViT-B
    train_dataset = _cifar10(root, ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)))  # doc: Caltech101(...)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=0.1)  # doc
    criterion = torch.nn.CrossEntropyLoss()  # doc
    lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=50, total_steps=NUM_EPOCHS)  # doc

    plugin = TorchDDPPlugin()  # doc
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
    )  # doc
    if not use_object:
        booster = Booster(mixed_precision="fp16", plugin=plugin)  # doc
    else:
        mixed_precision = FP16TorchMixedPrecision(
            init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
        )  # doc
        booster = Booster(mixed_precision=mixed_precision, plugin=plugin)  # doc
    model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, train_dataloader, lr_scheduler
    )  # doc (which passes an undefined `dataloader`)
    initial_scale = optimizer.loss_scale

    losses, dtypes = [], set()
    model.train()  # doc
    for _epoch in range(NUM_EPOCHS):  # doc
        for idx, (img, label) in enumerate(train_dataloader):  # doc: enumerate() bug fixed
            img = img.to(get_current_device())  # doc: img.cuda()
            label = label.to(get_current_device())  # doc: label.cuda()
            optimizer.zero_grad()  # doc
            output = model(img)  # doc
            loss = criterion(output, label)  # doc
            booster.backward(loss, optimizer)  # doc
            optimizer.step()  # doc
            losses.append(loss.item())
            dtypes.add(str(output.dtype))
            if idx == 1:  # two iterations per epoch
                break
        lr_scheduler.step()  # doc
    finite_params = all(torch.isfinite(p).all().item() for p in model.parameters())
    return [losses, sorted(dtypes), initial_scale, finite_params]


@pytest.mark.parametrize("use_object", [False, True], ids=["fp16-string", "fp16-object"])
def test_amp_training_with_booster_has_finite_loss(tmp_path: Path, use_object: bool) -> None:
    """§20.4: ``Booster(mixed_precision='fp16')`` and ``FP16TorchMixedPrecision(...)`` train a ViT
    on 2 ranks with finite losses, the forward pass runs in fp16 and the loss scale starts at
    2**16."""
    results = spawn(_amp_training, WORLD_SIZE, root=str(tmp_path / "data"), use_object=use_object)
    for losses, dtypes, initial_scale, finite_params in results:
        assert len(losses) == 4
        assert all(math.isfinite(x) for x in losses), losses
        assert dtypes == ["torch.float16"]
        assert initial_scale == 2.0**16
        assert finite_params
