"""Closed-form estimators: model-state memory, communication volume, pipeline bubbles, FLOPs.

Pure functions without a process group, used by the benchmarks and by tests that check measured
figures against theory. Notation follows the ZeRO paper (Rajbhandari et al., 2020): Ψ parameters,
N data-parallel ranks, K bytes of optimizer state per parameter (K = 12 for mixed-precision Adam:
fp32 master weights, momentum and variance).

Example:
    >>> model_state_bytes(1_000_000, "zero2", 4).total  # mixed-precision Adam: 2Ψ + (2+K)Ψ/N
    5500000.0
    >>> comm_volume_elements(1_000_000, "zero3", 4)  # 3Ψ(N-1)/N elements sent per rank
    2250000.0
    >>> bubble_fraction(pp_size=4, num_microbatches=8)  # (p-1)/(m+p-1)
    0.2727...
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COLLECTIVE_ALGORITHMS",
    "STRATEGIES",
    "ModelStateBytes",
    "PrecisionBytes",
    "bubble_fraction",
    "collective_sent_bytes",
    "comm_bytes_per_rank",
    "comm_volume_elements",
    "model_state_bytes",
    "precision_bytes",
    "transformer_train_flops_per_token",
]

#: data-parallel strategies the estimators know
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
#: collective algorithms :func:`collective_sent_bytes` models
COLLECTIVE_ALGORITHMS = ("ring", "gloo")


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter of each model state."""

    param: float
    """bytes of the working parameter copy (2 for fp16/bf16, 4 for fp32)"""
    grad: float
    """bytes of the gradient (same dtype as the working parameters)"""
    optim: float
    """K: bytes of optimizer state, fp32 master weights included when they exist"""


def precision_bytes(precision: str = "mixed", optimizer: str = "adam") -> PrecisionBytes:
    """Bytes per parameter for a training precision and optimizer.

    ``"mixed"``: fp16/bf16 parameters and gradients, fp32 master weights + states (K = 4 + states).
    ``"fp32"``: fp32 parameters and gradients, no master copy (K = states only), which is also what
    ``torch.autocast`` training (kolossos' ``fp16``/``bf16`` Booster recipes) keeps.

    Args:
        precision: ``"mixed"`` or ``"fp32"``.
        optimizer: ``"adam"`` (two fp32 states), ``"sgd_momentum"`` (one) or ``"sgd"`` (none).

    Raises:
        ValueError: an unknown precision or optimizer.

    Example:
        >>> precision_bytes("mixed")
        PrecisionBytes(param=2, grad=2, optim=12)
    """
    states = {"adam": 8, "sgd_momentum": 4, "sgd": 0}
    if optimizer not in states:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(states)}.")
    if precision == "mixed":
        return PrecisionBytes(param=2, grad=2, optim=4 + states[optimizer])
    if precision == "fp32":
        return PrecisionBytes(param=4, grad=4, optim=states[optimizer])
    raise ValueError(f"precision={precision!r} must be 'mixed' or 'fp32'.")


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes held by one rank."""

    params: float
    """working parameters"""
    grads: float
    """gradients"""
    optim: float
    """optimizer states (and master weights)"""

    @property
    def total(self) -> float:
        """``params + grads + optim``."""
        return self.params + self.grads + self.optim


def _check(num_params: int, world_size: int, strategy: str) -> None:
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params={num_params!r} must be an int >= 0.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1.")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}.")


def model_state_bytes(
    num_params: int,
    strategy: str,
    world_size: int,
    precision: PrecisionBytes | str = "mixed",
) -> ModelStateBytes:
    """Per-rank bytes of parameters, gradients and optimizer states.

    With P, G, K the bytes per parameter (``precision``; mixed-precision Adam: 2, 2, 12):
    DDP keeps everything (P+G+K)Ψ; ZeRO-1 shards the optimizer states, PΨ + GΨ + KΨ/N;
    ZeRO-2 also the gradients, PΨ + (G+K)Ψ/N; ZeRO-3 everything, (P+G+K)Ψ/N. Temporary buffers
    (DDP's gradient buckets, gathered ZeRO-3 parameters, activations) are not model states.

    Args:
        num_params: Ψ, the number of parameters.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        world_size: N, the data-parallel size.
        precision: ``"mixed"``, ``"fp32"`` (see :func:`precision_bytes`) or explicit bytes.

    Raises:
        ValueError: a negative size, an unknown strategy or precision.

    Example:
        >>> model_state_bytes(10, "ddp", 2, "fp32").total  # 4 + 4 + 8 bytes per parameter
        160.0
    """
    _check(num_params, world_size, strategy)
    b = precision_bytes(precision) if isinstance(precision, str) else precision
    psi, n = num_params, world_size
    shards = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}
    sp, sg, so = shards[strategy]
    return ModelStateBytes(
        params=b.param * psi / sp, grads=b.grad * psi / sg, optim=b.optim * psi / so
    )


def comm_volume_elements(
    num_params: int, strategy: str, world_size: int, *, asymptotic: bool = False
) -> float:
    """Elements each rank sends per training step with bandwidth-optimal (ring) collectives.

    DDP all-reduces the gradients (reduce-scatter + all-gather: 2Ψ); ZeRO-1 and ZeRO-2
    reduce-scatter the gradients and all-gather the updated parameters (2Ψ); ZeRO-3 all-gathers
    the parameters in forward and again in backward and reduce-scatters the gradients (3Ψ).
    Each ring pass moves (N-1)/N of the data, so the exact figure is ``c·Ψ·(N-1)/N``; with
    ``asymptotic=True`` it is the paper's ``c·Ψ``. Multiply by the element size for bytes
    (:func:`comm_bytes_per_rank`).

    Raises:
        ValueError: a negative size or an unknown strategy.

    Example:
        >>> comm_volume_elements(100, "ddp", 2)
        100.0
    """
    _check(num_params, world_size, strategy)
    passes = 3 if strategy == "zero3" else 2
    factor = 1.0 if asymptotic else (world_size - 1) / world_size
    return passes * num_params * factor


def comm_bytes_per_rank(
    num_params: int, strategy: str, world_size: int, element_bytes: int = 2
) -> float:
    """:func:`comm_volume_elements` times ``element_bytes`` (2 for fp16/bf16 gradients, 4 for
    fp32): the bytes one rank sends per step with ring collectives."""
    return comm_volume_elements(num_params, strategy, world_size) * element_bytes


def collective_sent_bytes(
    kind: str, nbytes: float, world_size: int, algorithm: str = "ring"
) -> float:
    """Bytes one rank sends for one collective over ``nbytes`` of data.

    ``nbytes`` is the logical size the collective works on (the convention of
    :class:`~kolossos.utils.profiling.CommCounter`): the tensor for all-reduce and broadcast, the
    full input for reduce-scatter and all-to-all, the gathered output for all-gather.

    ``"ring"`` is the bandwidth-optimal model (NCCL's ring): all-reduce 2(N-1)/N, reduce-scatter
    and all-gather and all-to-all (N-1)/N, broadcast and reduce (N-1)/N on average per rank.
    ``"gloo"`` is what torch 2.13's gloo backend was measured to send (``docs/benchmarks.md``): the
    same, except that reduce-scatter runs a full all-reduce, 2(N-1)/N.

    Raises:
        ValueError: an unknown kind or algorithm, or a world size below 1.

    Example:
        >>> collective_sent_bytes("all_reduce", 1000, 4)
        1500.0
        >>> collective_sent_bytes("reduce_scatter", 1000, 4, "gloo")
        1500.0
    """
    if algorithm not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} must be one of {COLLECTIVE_ALGORITHMS}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1.")
    ring = (world_size - 1) / world_size
    factors = {
        "all_reduce": 2 * ring,
        "reduce_scatter": (2 if algorithm == "gloo" else 1) * ring,
        "all_gather": ring,
        "all_to_all": ring,
        "broadcast": ring,
        "reduce": ring,
        "gather": ring,
        "scatter": ring,
        "send": 1.0,
        "recv": 0.0,
        "barrier": 0.0,
    }
    if kind not in factors:
        raise ValueError(f"kind={kind!r} must be one of {sorted(factors)}.")
    return nbytes * factors[kind]


def bubble_fraction(
    pp_size: int, num_microbatches: int, schedule: str = "1f1b", num_chunks: int = 1
) -> float:
    """Fraction of a pipeline step that a stage sits idle (the bubble), equal-cost stages.

    GPipe and 1F1B: ``(p-1)/(m+p-1)``. Interleaved 1F1B with ``v`` model chunks per stage shrinks
    the bubble by ``v``: ``(p-1)/(v·m+p-1)``. (As a ratio to the useful time, the same bubbles
    are ``(p-1)/m`` and ``(p-1)/(v·m)``, the form in the Megatron-LM paper.)

    Args:
        pp_size: p, pipeline stages.
        num_microbatches: m, micro-batches per step.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        num_chunks: v, model chunks per stage (``"interleaved"`` only; 1 otherwise).

    Raises:
        ValueError: sizes below 1, an unknown schedule, or chunks without interleaving.

    Example:
        >>> bubble_fraction(2, 4)
        0.2
        >>> bubble_fraction(2, 4, "interleaved", num_chunks=2)
        0.1111...
    """
    for name, value in (
        ("pp_size", pp_size),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1.")
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"schedule={schedule!r} must be 'gpipe', '1f1b' or 'interleaved'.")
    if schedule != "interleaved" and num_chunks != 1:
        raise ValueError(f"num_chunks={num_chunks} needs schedule='interleaved'.")
    p, m, v = pp_size, num_microbatches, num_chunks
    return (p - 1) / (v * m + p - 1)


def transformer_train_flops_per_token(
    num_params: int, num_layers: int, hidden_size: int, seq_len: int
) -> float:
    """Model FLOPs of one training token of a decoder: ``6·Ψ + 12·L·h·s``.

    Forward + backward cost 3× the forward's 2 FLOPs per multiply-add of every weight (``6Ψ``;
    count the tied embedding once, as the output projection) plus causal attention scores and
    values (``12·L·h·s``). Activation recomputation is not model FLOPs and is not counted.

    Example:
        >>> transformer_train_flops_per_token(1000, 2, 16, 8)
        9072
    """
    return 6 * num_params + 12 * num_layers * hidden_size * seq_len
