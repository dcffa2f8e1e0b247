"""``ModelWrapper``: what a plugin returns for a model; ``unwrap()`` gives the user's module."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


class ModelWrapper(nn.Module):
    """A module wrapping another (possibly wrapped) module, forwarding calls to it.

    Plugins and mixed-precision recipes return subclasses; ``unwrap()`` strips every layer of
    wrapping (ours and torch's ``DistributedDataParallel``), so checkpoints and user code see the
    original module.

    Args:
        module: the module to wrap.

    Example:
        >>> wrapped = ModelWrapper(nn.Linear(2, 2))
        >>> isinstance(wrapped.unwrap(), nn.Linear)
        True
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self) -> nn.Module:
        """The innermost user module."""
        return unwrap_model(self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def unwrap_model(module: nn.Module) -> nn.Module:
    """Strip :class:`ModelWrapper` and torch DDP layers until the user's module is reached."""
    while isinstance(module, (ModelWrapper, DistributedDataParallel)):
        module = module.module
    return module
