"""A small model zoo for the tutorials and tests: ResNet-18/34/50 and Vision Transformers.

Example:
    >>> import torch
    >>> from kolossos.models import resnet18
    >>> model = resnet18(num_classes=10, cifar_stem=True)
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from kolossos.models.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50
from kolossos.models.vit import VisionTransformer, vit_base, vit_small, vit_tiny

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "VisionTransformer",
    "resnet18",
    "resnet34",
    "resnet50",
    "vit_base",
    "vit_small",
    "vit_tiny",
]
