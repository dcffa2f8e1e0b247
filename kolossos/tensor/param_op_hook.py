"""``ColoParamOpHook`` / ``ColoParamOpHookManager``: Colossal-AI's hooks around operators on
parameters. kolossos' Gemini fetches chunks with module hooks instead, so operator-level hooks
are not run: the base class is kept for type compatibility and installing hooks raises."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["ColoParamOpHook", "ColoParamOpHookManager"]


class ColoParamOpHook(ABC):
    """Callbacks before/after the forward/backward of an operator that uses parameters."""

    @abstractmethod
    def pre_forward(self, params: list[torch.Tensor]) -> None:
        """Before the forward of an operator on ``params``."""

    @abstractmethod
    def post_forward(self, params: list[torch.Tensor]) -> None:
        """After the forward of an operator on ``params``."""

    @abstractmethod
    def pre_backward(self, params: list[torch.Tensor]) -> None:
        """Before the backward of an operator on ``params``."""

    @abstractmethod
    def post_backward(self, params: list[torch.Tensor]) -> None:
        """After the backward of an operator on ``params``."""


class ColoParamOpHookManager:
    """Installs :class:`ColoParamOpHook` objects (not supported: see the module docstring)."""

    @staticmethod
    @contextmanager
    def use_hooks(*hooks: ColoParamOpHook) -> Iterator[None]:
        """Raises ``NotImplementedError``: operator-level parameter hooks are not run.

        Raises:
            NotImplementedError: always, naming the alternative.
        """
        raise NotImplementedError(
            "ColoParamOpHookManager.use_hooks: operator-level parameter hooks are not supported; "
            "use module hooks (register_forward_pre_hook) or GeminiDDP, which fetches chunks "
            "itself."
        )
        yield  # pragma: no cover

    @staticmethod
    def has_hook() -> bool:
        """Whether hooks are installed (never)."""
        return False
