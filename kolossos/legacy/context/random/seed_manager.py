"""``SeedManager``: one RNG state per parallel mode on the accelerator's default generator
(the CUDA generator on GPUs, torch's CPU generator on CPU)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kolossos.accelerator import get_accelerator

__all__ = ["SeedManager"]


class SeedManager:
    """Keeps a seed and a saved generator state per mode; ``set_mode`` swaps them in.

    Example:
        >>> manager = SeedManager()
        >>> manager.add_seed(ParallelMode.DATA, 1024)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._current_mode: Hashable | None = None
        self._seeds: dict[Hashable, int] = {}
        self._seed_states: dict[Hashable, torch.Tensor] = {}

    @property
    def current_mode(self) -> Hashable | None:
        """The mode whose state the generator holds now (``None``: none was set)."""
        return self._current_mode

    @property
    def seeds(self) -> dict[Hashable, int]:
        """mode -> seed."""
        return self._seeds

    @property
    def seed_states(self) -> dict[Hashable, torch.Tensor]:
        """mode -> saved generator state."""
        return self._seed_states

    def set_state(self, parallel_mode: Hashable, state: torch.Tensor) -> None:
        """Replace the saved state of a mode that has a seed.

        Raises:
            KeyError: no seed was added for ``parallel_mode``.
        """
        self._check_known(parallel_mode)
        self._seed_states[parallel_mode] = state

    def set_mode(self, parallel_mode: Hashable | None) -> None:
        """Save the generator into the current mode's slot and load ``parallel_mode``'s state
        (``None``: keep the generator as it is and forget the current mode).

        Raises:
            KeyError: no seed was added for ``parallel_mode``.
        """
        accelerator = get_accelerator()
        if parallel_mode is not None:
            self._check_known(parallel_mode)
        if self._current_mode is not None:
            self._seed_states[self._current_mode] = accelerator.get_rng_state()
        self._current_mode = parallel_mode
        if parallel_mode is not None:
            accelerator.set_rng_state(self._seed_states[parallel_mode])

    def add_seed(self, parallel_mode: Hashable, seed: int, overwrite: bool = False) -> None:
        """Create the state of ``parallel_mode`` from ``seed`` (the generator is left as it was).

        Raises:
            TypeError: ``seed`` is not an int.
            ValueError: a seed exists for the mode and ``overwrite`` is False.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} for {parallel_mode} must be an int.")
        if parallel_mode in self._seed_states and not overwrite:
            raise ValueError(
                f"the seed of {parallel_mode} is set already; pass overwrite=True to replace it."
            )
        accelerator = get_accelerator()
        saved = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self._seed_states[parallel_mode] = accelerator.get_rng_state()
        self._seeds[parallel_mode] = seed
        accelerator.set_rng_state(saved)

    def reset(self) -> None:
        """Forget every seed and the current mode."""
        self._current_mode = None
        self._seeds = {}
        self._seed_states = {}

    def _check_known(self, parallel_mode: Hashable) -> None:
        if parallel_mode not in self._seed_states:
            known = ", ".join(str(m) for m in self._seed_states) or "none"
            raise KeyError(
                f"no seed was added for {parallel_mode} (seeded modes: {known}); call "
                "add_seed(mode, seed) first, or launch with a parallel config."
            )
