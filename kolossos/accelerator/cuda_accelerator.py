"""The CUDA accelerator: NVIDIA GPUs (and ROCm, which torch exposes as ``cuda``), ``nccl``.

Memory statistics come from torch's caching allocator (``torch.cuda.memory_allocated`` and friends),
which is exact for tensors and needs no tracker.
"""

from __future__ import annotations

import torch

from kolossos.accelerator.base_accelerator import BaseAccelerator

__all__ = ["CudaAccelerator"]


class CudaAccelerator(BaseAccelerator):
    """GPUs driven through ``torch.cuda``; ranks communicate over ``nccl``.

    Methods taking ``index`` default to the current device (``torch.cuda.current_device()``).

    Example:
        >>> acc = CudaAccelerator()
        >>> acc.set_device(local_rank)
        >>> x = torch.zeros(4, device=acc.get_current_device())
        >>> acc.max_memory_allocated()
    """

    name = "cuda"
    communication_backend = "nccl"
    amp_device_type = "cuda"

    # ------------------------------------------------------------------ device
    def is_available(self) -> bool:
        """Return whether torch was built with CUDA and sees at least one GPU."""
        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        """Return the number of visible GPUs (honours ``CUDA_VISIBLE_DEVICES``)."""
        return int(torch.cuda.device_count())

    def current_device(self) -> int:
        """Return the index of the current GPU."""
        return int(torch.cuda.current_device())

    def set_device(self, index: int) -> None:
        """Make GPU ``index`` current for this process.

        Raises:
            ValueError: ``index`` is not in ``[0, device_count())``.
        """
        self._check_index(index)
        torch.cuda.set_device(index)

    def get_device_name(self, index: int | None = None) -> str:
        """Return the GPU's marketing name, e.g. ``"NVIDIA H100 80GB HBM3"``."""
        return str(torch.cuda.get_device_name(self._index(index)))

    def synchronize(self, index: int | None = None) -> None:
        """Block until every kernel queued on GPU ``index`` (default: current) has finished."""
        torch.cuda.synchronize(self._index(index))  # sync point

    def is_bf16_supported(self) -> bool:
        """Return whether the current GPU computes in bfloat16 natively."""
        return bool(torch.cuda.is_bf16_supported())

    # ------------------------------------------------------------------ random numbers
    def manual_seed(self, seed: int) -> None:
        """Seed the generator of the current GPU."""
        self._check_seed(seed)
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of all visible GPUs."""
        self._check_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """Return the generator state of GPU ``index`` (default: current)."""
        return torch.cuda.get_rng_state(self._index(index))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore the generator state of GPU ``index`` (default: current)."""
        torch.cuda.set_rng_state(state, self._index(index))

    # ------------------------------------------------------------------ memory
    def empty_cache(self) -> None:
        """Release the caching allocator's unused blocks back to the driver."""
        torch.cuda.empty_cache()

    def memory_allocated(self, index: int | None = None) -> int:
        """Return bytes occupied by live tensors on GPU ``index`` (default: current)."""
        return int(torch.cuda.memory_allocated(self._index(index)))

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Return the peak of :meth:`memory_allocated` since start or the last reset."""
        return int(torch.cuda.max_memory_allocated(self._index(index)))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart the allocator's peak statistics on GPU ``index`` (default: current)."""
        torch.cuda.reset_peak_memory_stats(self._index(index))

    def memory_reserved(self, index: int | None = None) -> int:
        """Return bytes held by the caching allocator (allocated plus cached) on GPU ``index``."""
        return int(torch.cuda.memory_reserved(self._index(index)))

    def total_memory(self, index: int | None = None) -> int:
        """Return the capacity of GPU ``index`` in bytes."""
        return int(torch.cuda.get_device_properties(self._index(index)).total_memory)

    def _index(self, index: int | None) -> int:
        """Return ``index``, or the current device when it is ``None`` (validated)."""
        if index is None:
            return self.current_device()
        self._check_index(index)
        return index
