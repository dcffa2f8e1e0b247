"""``Accelerator``: the Booster-generation device wrapper of Colossal-AI
(``colossalai.booster.accelerator``), which moves a model to one device.

The rest of kolossos asks :func:`kolossos.accelerator.get_accelerator` for its device; this class
exists so scripts written against the older Booster API keep working.
"""

from __future__ import annotations

import torch
from torch import nn

from kolossos.accelerator import get_accelerator

__all__ = ["SUPPORTED_DEVICES", "Accelerator"]

#: the device types :class:`Accelerator` accepts (Colossal-AI's list)
SUPPORTED_DEVICES = ("cpu", "cuda")


class Accelerator:
    """The hardware a model runs on: binds the process to it and moves models there.

    Args:
        device: ``"cpu"`` or ``"cuda"``, optionally with an index (``"cuda:1"``).

    Raises:
        ValueError: ``device`` is not a device name of :data:`SUPPORTED_DEVICES`.
        RuntimeError: ``device`` is ``"cuda"`` but CUDA is not available.

    Example:
        >>> acc = Accelerator("cpu")
        >>> model = acc.configure_model(torch.nn.Linear(4, 2))
        >>> next(model.parameters()).device.type
        'cpu'
    """

    def __init__(self, device: str) -> None:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"Accelerator(device={device!r}) is not a device name; pass one of "
                f"{list(SUPPORTED_DEVICES)}."
            ) from exc
        if parsed.type not in SUPPORTED_DEVICES:
            raise ValueError(
                f"Accelerator(device={device!r}): device type {parsed.type!r} is not supported; "
                f"pass one of {list(SUPPORTED_DEVICES)}."
            )
        if parsed.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"Accelerator(device={device!r}) needs CUDA, which is not available on this "
                "machine; pass device='cpu'."
            )
        self.device = device

    def bind(self) -> None:
        """Make this device the process's current device (a no-op for the CPU)."""
        parsed = torch.device(self.device)
        if parsed.type == "cuda":
            accelerator = get_accelerator()
            index = parsed.index if parsed.index is not None else accelerator.current_device()
            accelerator.set_device(index)

    def configure_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to this device and return it.

        Args:
            model: the model to move (in place, as ``nn.Module.to`` does).

        Returns:
            The same model, on :attr:`device`.
        """
        return model.to(torch.device(self.device))

    def __repr__(self) -> str:
        return f"Accelerator(device={self.device!r})"
