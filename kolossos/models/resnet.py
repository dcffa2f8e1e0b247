"""ResNet-18/34/50 (He et al., 2015) with an optional CIFAR stem, written for kolossos's tutorials.

The layer counts, widths and parameter counts are the standard ones (ResNet-50 puts the stride on
the 3x3 convolution, the "v1.5" variant most frameworks ship). Sub-module names follow the usual
convention (``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1``..``layer4``, ``avgpool``, ``fc``;
inside a block ``conv1``, ``bn1``, ..., ``downsample.0/1``), so the state-dict keys are stable and
pipeline-splitting recipes that name these modules work unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50"]


def _conv(in_ch: int, out_ch: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2, bias=False)


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module | None:
    """A 1x1 projection (conv + BN) where the residual's shape changes, else None (identity)."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(_conv(in_ch, out_ch, 1, stride), nn.BatchNorm2d(out_ch))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34).

    Args:
        in_channels: channels of the input.
        width: channels of both convolutions; the output has ``width * expansion`` channels.
        stride: stride of the first convolution (2 halves the resolution).
    """

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv(in_channels, width, 3, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(width, width, 3)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _shortcut(in_channels, width, stride)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm closing the residual branch (zeroed by ``zero_init_residual``)."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a residual connection (ResNet-50).

    Args:
        in_channels: channels of the input.
        width: channels of the inner convolutions; the output has ``width * 4`` channels.
        stride: stride of the 3x3 convolution.
    """

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = _conv(in_channels, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, out_channels, 1)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm closing the residual branch (zeroed by ``zero_init_residual``)."""
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A residual network: stem, four stages of blocks, global average pool, linear classifier.

    Weights are drawn from torch's global RNG (Kaiming-normal convolutions, unit/zero BatchNorm,
    PyTorch's default Linear init), so ``torch.manual_seed(s)`` before construction makes them
    reproducible.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages, e.g. ``(2, 2, 2, 2)`` for ResNet-18.
        num_classes: outputs of the final ``fc`` layer.
        in_channels: channels of the input images.
        cifar_stem: for 32x32 inputs: a 3x3 stride-1 stem convolution and no max-pool (``maxpool``
            is then an ``nn.Identity``) instead of the ImageNet 7x7 stride-2 convolution + max-pool.
        base_width: channels of the first stage (64 in the standard models; smaller for tests).
        zero_init_residual: start every residual branch at zero (its last BatchNorm's weight = 0),
            which often helps large-batch training.

    Raises:
        ValueError: ``layers`` does not have four positive entries, or a size is not positive.

    Example:
        >>> model = ResNet(BasicBlock, (1, 1, 1, 1), num_classes=10, cifar_stem=True, base_width=8)
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        num_classes: int = 1000,
        *,
        in_channels: int = 3,
        cifar_stem: bool = False,
        base_width: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(
                f"layers={tuple(layers)} must hold four block counts >= 1, e.g. (2, 2, 2, 2)."
            )
        for name, value in (
            ("num_classes", num_classes),
            ("in_channels", in_channels),
            ("base_width", base_width),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1.")
        if cifar_stem:
            self.conv1 = _conv(in_channels, base_width, 3)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, base_width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(base_width)
        self.relu = nn.ReLU(inplace=True)
        channels = base_width
        stages = []
        for i, count in enumerate(layers):
            width = base_width * 2**i
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(count):
                blocks.append(block(channels, width, stride if j == 0 else 1))
                channels = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(module.last_bn.weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled features before ``fc``: shape ``(batch, channels)``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of shape ``(batch, num_classes)`` for images ``(batch, C, H, W)``."""
        return self.fc(self.forward_features(x))


def resnet18(
    num_classes: int = 1000,
    *,
    in_channels: int = 3,
    cifar_stem: bool = False,
    zero_init_residual: bool = False,
) -> ResNet:
    """ResNet-18: :class:`BasicBlock` x (2, 2, 2, 2); 11,689,512 parameters at 1000 classes.

    Args:
        num_classes: outputs of the classifier.
        in_channels: channels of the input images.
        cifar_stem: use the 3x3 stem without max-pool, for 32x32 inputs (see :class:`ResNet`).
        zero_init_residual: start every residual branch at zero.

    Example:
        >>> resnet18(num_classes=10, cifar_stem=True)(torch.randn(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    return ResNet(
        BasicBlock,
        (2, 2, 2, 2),
        num_classes,
        in_channels=in_channels,
        cifar_stem=cifar_stem,
        zero_init_residual=zero_init_residual,
    )


def resnet34(
    num_classes: int = 1000,
    *,
    in_channels: int = 3,
    cifar_stem: bool = False,
    zero_init_residual: bool = False,
) -> ResNet:
    """ResNet-34: :class:`BasicBlock` x (3, 4, 6, 3); 21,797,672 parameters at 1000 classes.

    Args: as :func:`resnet18`.

    Example:
        >>> with torch.device("meta"):  # shapes only, no memory or init cost
        ...     model = resnet34()
        >>> sum(p.numel() for p in model.parameters())
        21797672
    """
    return ResNet(
        BasicBlock,
        (3, 4, 6, 3),
        num_classes,
        in_channels=in_channels,
        cifar_stem=cifar_stem,
        zero_init_residual=zero_init_residual,
    )


def resnet50(
    num_classes: int = 1000,
    *,
    in_channels: int = 3,
    cifar_stem: bool = False,
    zero_init_residual: bool = False,
) -> ResNet:
    """ResNet-50: :class:`Bottleneck` x (3, 4, 6, 3); 25,557,032 parameters at 1000 classes.

    Args: as :func:`resnet18`.

    Example:
        >>> with torch.device("meta"):
        ...     model = resnet50()
        >>> sum(p.numel() for p in model.parameters())
        25557032
    """
    return ResNet(
        Bottleneck,
        (3, 4, 6, 3),
        num_classes,
        in_channels=in_channels,
        cifar_stem=cifar_stem,
        zero_init_residual=zero_init_residual,
    )
