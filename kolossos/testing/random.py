"""Seeding for tests, with Colossal-AI's ``colossalai.testing.random.seed_all`` signature."""

from __future__ import annotations

__all__ = ["seed_all"]


def seed_all(seed: int, cuda_deterministic: bool = False) -> None:
    """Seed python's ``random``, numpy, torch (CPU and every CUDA device) and set cuDNN's mode.

    Args:
        seed: a non-negative integer.
        cuda_deterministic: ``True`` selects deterministic cuDNN kernels and turns off cuDNN's
            autotuner (slower, reproducible); ``False`` does the opposite, as upstream does
            (``cudnn.deterministic = False``, ``cudnn.benchmark = True``). Both settings are
            process-wide and have no effect on CPU work.

    Raises:
        ValueError: ``seed`` is not a non-negative integer.

    Example:
        >>> seed_all(1024)
    """
    import torch

    from kolossos.utils.seed import set_seed

    # random, numpy and torch.manual_seed, which seeds every device's generator (CUDA lazily,
    # without creating a context)
    set_seed(seed)
    torch.backends.cudnn.deterministic = cuda_deterministic
    torch.backends.cudnn.benchmark = not cuda_deterministic
