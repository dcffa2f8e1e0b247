"""The model zoo: standard architectures (parameter counts), shapes, determinism, training."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from kolossos.models import (
    BasicBlock,
    Bottleneck,
    ResNet,
    VisionTransformer,
    resnet18,
    resnet34,
    resnet50,
    vit_base,
    vit_small,
    vit_tiny,
)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        # The torchvision / timm figures for 1000 classes: they pin the standard architectures.
        (resnet18, 11_689_512),
        (resnet34, 21_797_672),
        (resnet50, 25_557_032),
        (vit_tiny, 5_717_416),
        (vit_small, 22_050_664),
        (vit_base, 86_567_656),
    ],
)
def test_parameter_counts_match_the_standard_models(
    factory: Callable[[], nn.Module], expected: int
) -> None:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = factory()
    assert n_params(model) == expected


def test_cifar_stem_changes_only_the_stem() -> None:
    with torch.device("meta"):
        imagenet, cifar = resnet18(), resnet18(cifar_stem=True)
    assert n_params(imagenet) - n_params(cifar) == 64 * 3 * (7 * 7 - 3 * 3)
    assert isinstance(cifar.maxpool, nn.Identity)
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)


def test_state_dict_keys_are_stable() -> None:
    with torch.device("meta"):
        keys = set(resnet50().state_dict())
        vit_keys = set(vit_tiny().state_dict())
    for key in ("conv1.weight", "bn1.running_mean", "layer1.0.conv3.weight",
                "layer2.0.downsample.0.weight", "layer4.2.bn3.bias", "fc.weight"):  # fmt: skip
        assert key in keys
    for key in ("patch_embed.proj.weight", "cls_token", "pos_embed", "blocks.0.attn.qkv.weight",
                "blocks.11.mlp.fc2.bias", "norm.weight", "head.bias"):  # fmt: skip
        assert key in vit_keys


@torch.no_grad()
def test_resnet_output_shapes() -> None:
    torch.manual_seed(0)
    cifar = resnet18(num_classes=10, cifar_stem=True).eval()
    assert cifar(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    imagenet = resnet18(num_classes=7).eval()
    assert imagenet(torch.randn(1, 3, 224, 224)).shape == (1, 7)
    # The ImageNet stem downsamples 32x; a 32x32 image still works (1x1 final map).
    assert imagenet(torch.randn(1, 3, 32, 32)).shape == (1, 7)
    tiny = ResNet(BasicBlock, (1, 1, 1, 1), 5, in_channels=1, cifar_stem=True, base_width=4)
    assert tiny.eval()(torch.randn(3, 1, 32, 32)).shape == (3, 5)


@torch.no_grad()
def test_vit_output_shapes() -> None:
    torch.manual_seed(0)
    small = VisionTransformer(image_size=32, patch_size=4, num_classes=10, dim=48, depth=2, heads=3)
    assert small.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    big = VisionTransformer(image_size=224, patch_size=16, num_classes=3, dim=32, depth=1, heads=2)
    assert big.eval()(torch.randn(1, 3, 224, 224)).shape == (1, 3)
    with pytest.raises(ValueError, match="image_size=224"):
        big(torch.randn(1, 3, 32, 32))


def test_bottleneck_forward_at_224() -> None:
    model = ResNet(Bottleneck, (1, 1, 1, 1), 4, base_width=8)
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 224, 224)).shape == (1, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"patch_size": 5}, "patch_size=5 must divide image_size=32"),
        ({"heads": 5}, "heads=5 must divide dim=48"),
        ({"depth": 0}, "depth=0 must be >= 1"),
        ({"mlp_ratio": 0.0}, "mlp_ratio"),
    ],
)
def test_vit_validation(kwargs: dict[str, float], match: str) -> None:
    args = {"image_size": 32, "patch_size": 4, "dim": 48, "depth": 1, "heads": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        VisionTransformer(**args)  # type: ignore[arg-type]


def test_resnet_validation() -> None:
    with pytest.raises(ValueError, match="four block counts"):
        ResNet(BasicBlock, (2, 2, 2))


def test_init_is_deterministic_from_the_global_seed() -> None:
    def build() -> dict[str, torch.Tensor]:
        torch.manual_seed(123)
        model = nn.ModuleList(
            [
                ResNet(BasicBlock, (1, 1, 1, 1), 10, cifar_stem=True, base_width=8),
                VisionTransformer(32, 8, 10, dim=32, depth=1, heads=2),
            ]
        )
        return model.state_dict()

    a, b = build(), build()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    torch.manual_seed(124)
    other = ResNet(BasicBlock, (1, 1, 1, 1), 10, cifar_stem=True, base_width=8)
    assert not torch.equal(other.conv1.weight, a["0.conv1.weight"])


def test_zero_init_residual() -> None:
    model = ResNet(BasicBlock, (1, 1, 1, 1), 10, base_width=4, zero_init_residual=True)
    blocks = [b for b in model.modules() if isinstance(b, BasicBlock)]
    assert len(blocks) == 4 and all(b.bn2.weight.abs().sum() == 0 for b in blocks)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", ["basic", "bottleneck", "vit"])
def test_training_reduces_loss_on_a_fixed_batch(arch: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    # Narrow versions of the same code paths keep this fast; the full widths are pinned above.
    model: nn.Module
    if arch == "vit":
        model = VisionTransformer(32, 8, 10, dim=64, depth=2, heads=4)
    else:
        block = BasicBlock if arch == "basic" else Bottleneck
        model = ResNet(block, (1, 1, 1, 1), 10, cifar_stem=True, base_width=8)
    losses = _train(model.train(), x, y, steps=10)
    assert losses[-1] < 0.5 * losses[0], losses


def test_full_resnet18_training_steps_reduce_loss() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    losses = _train(resnet18(num_classes=10, cifar_stem=True).train(), x, y, steps=3)
    assert losses[-1] < losses[0], losses
