"""The options of ``kolossos benchmark``, checked: Colossal-AI's ``colossalai benchmark`` flags
(``--gpus``, ``--batch_size``, ``--seq_len``, ``--dimension``, ``--warmup_steps``,
``--profile_steps``, ``--layers``, ``--model``) with kolossos's ``--nproc`` and ``--json``.

No torch import here: the command line parses and checks everything before a process starts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kolossos.cli.benchmark.layouts import Sizes

__all__ = ["MODELS", "BenchmarkOptions"]

#: the models the benchmark can run (Colossal-AI's ``--model`` choices)
MODELS = ("mlp",)


@dataclass(frozen=True, kw_only=True)
class BenchmarkOptions:
    """What to benchmark; the defaults are Colossal-AI's.

    Raises:
        ValueError: a value out of range, naming the flag, the rule and the fix.
    """

    nproc: int
    """Processes (``--nproc`` / ``--gpus``): one per device on GPUs, any number on the CPU."""
    batch_size: int = 8
    """Samples per step (the global batch)."""
    seq_len: int = 512
    """Tokens per sample."""
    dimension: int = 1024
    """Hidden size of the MLP."""
    warmup_steps: int = 10
    """Steps run before timing."""
    profile_steps: int = 50
    """Steps timed."""
    layers: int = 2
    """``Linear(dimension, dimension)`` layers in the MLP."""
    model: str = "mlp"
    """The model (only ``mlp``)."""
    seed: int = 1024
    """Seed of the weights and the inputs (the same on every rank)."""

    def __post_init__(self) -> None:
        minimums = {
            "nproc": (1, "the number of processes to benchmark on"),
            "batch_size": (1, "samples per step"),
            "seq_len": (1, "tokens per sample"),
            "dimension": (1, "the hidden size"),
            "warmup_steps": (0, "untimed steps"),
            "profile_steps": (1, "at least one step must be timed"),
            "layers": (1, "the MLP needs a layer"),
        }
        for name, (low, why) in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                flag = "--nproc" if name == "nproc" else f"--{name}"
                raise ValueError(f"{flag} {value!r} must be an integer >= {low} ({why}); "
                                 f"pass e.g. {flag} {max(low, 1) * 2}.")  # fmt: skip
        if self.model.lower() not in MODELS:
            raise ValueError(
                f"--model {self.model!r} is not a benchmark model; the choices are "
                f"{', '.join(MODELS)}."
            )
        object.__setattr__(self, "model", self.model.lower())

    @property
    def sizes(self) -> Sizes:
        """The sizes the layouts' divisibility rules read."""
        return Sizes(batch_size=self.batch_size, dimension=self.dimension)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchmarkOptions:
        """The options :meth:`as_dict` wrote."""
        return cls(**data)
