"""Which optimizers may step flat shards: the ZeRO engines' rule.

LowLevelZero and Gemini flatten parameters into buffers and give each rank a contiguous slice,
which cuts across parameters; the wrapped optimizer steps those slices. That is exact for
element-wise optimizers (SGD, Adam and its kin: each element's update depends on that element
only). Optimizers that take a norm or a statistic over a whole parameter — LAMB's and LARS'
trust ratios, Adafactor's factored second moments, L-BFGS — would compute it over a slice
instead, and silently train a different model. :func:`check_flat_shard_safe` refuses them.
"""

from __future__ import annotations

from torch.optim import Optimizer

__all__ = ["PER_PARAMETER_OPTIMIZERS", "check_flat_shard_safe"]

#: ``(module prefix, class name)`` of optimizers whose update needs whole parameters
PER_PARAMETER_OPTIMIZERS: tuple[tuple[str, str], ...] = (
    ("kolossos.nn.optimizer", "Lamb"),
    ("kolossos.nn.optimizer", "Lars"),
    ("kolossos.nn.optimizer", "FusedLAMB"),
    ("kolossos.nn.optimizer", "DistributedLamb"),
    ("kolossos.nn.optimizer", "DistributedAdaFactor"),
    ("torch.optim", "LBFGS"),
    ("torch.optim", "Adafactor"),
    ("transformers", "Adafactor"),
)


def check_flat_shard_safe(optimizer: Optimizer, engine: str) -> None:
    """Raise unless ``optimizer`` may step the flat shards of ``engine`` (module doc).

    Raises:
        ValueError: an optimizer that needs whole parameters (named, with the alternatives).
    """
    for cls in type(optimizer).__mro__:
        for prefix, name in PER_PARAMETER_OPTIMIZERS:
            if cls.__name__ == name and cls.__module__.startswith(prefix):
                raise ValueError(
                    f"{type(optimizer).__name__} computes per-parameter norms or statistics, "
                    f"but {engine} steps it on shards that cut across parameters, so it "
                    "would train a different model than one process does. Use an element-wise "
                    "optimizer (SGD, Adam/AdamW, HybridAdam, ...) with this plugin, or keep "
                    f"{type(optimizer).__name__} with TorchDDPPlugin (whole parameters)."
                )
