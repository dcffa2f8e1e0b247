"""Parallel layouts the planner considers, and the Python call that builds each one.

A :class:`Layout` is one plugin with its arguments (and whether the model checkpoints its
activations). :func:`candidate_layouts` lists every layout that makes sense for a model on a
number of ranks; :meth:`Layout.plugin_call` writes the plugin's constructor call, the code a user
pastes into a training script.

Example:
    >>> Layout(plugin="zero", precision="bf16", dp=8, zero_stage=2).plugin_call()
    'LowLevelZeroPlugin(stage=2, precision="bf16")'
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kolossos.utils.profiling.model_shape import ModelShape

__all__ = ["PLUGINS", "PRECISIONS", "Layout", "candidate_layouts"]

#: plugin keys -> class names
PLUGINS = {
    "ddp": "TorchDDPPlugin",
    "zero": "LowLevelZeroPlugin",
    "gemini": "GeminiPlugin",
    "fsdp": "TorchFSDPPlugin",
    "hybrid": "HybridParallelPlugin",
}
#: training precisions
PRECISIONS = ("fp32", "fp16", "bf16")
#: how simple each plugin is to run and debug (the recommendation prefers lower)
COMPLEXITY = {"ddp": 0, "zero": 1, "fsdp": 2, "gemini": 2, "hybrid": 3}
#: the activation-checkpointing line printed with layouts that need it
CHECKPOINTING_CALL = (
    'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to train: a plugin, its arguments and the process layout."""

    plugin: str
    """``ddp``, ``zero``, ``gemini``, ``fsdp`` or ``hybrid`` (:data:`PLUGINS`)"""
    precision: str
    """``fp32``, ``fp16`` or ``bf16``"""
    dp: int
    """data-parallel size"""
    tp: int = 1
    """tensor-parallel size"""
    pp: int = 1
    """pipeline stages"""
    zero_stage: int = 0
    """0 (replicated states), 1, 2 (LowLevelZero), 3 (Gemini / FSDP)"""
    offload: bool = False
    """optimizer states (and fp32 masters, gradient shards) in host memory"""
    placement: str = "static"
    """Gemini's placement policy: ``static`` or ``auto``"""
    offload_param: bool = False
    """Gemini static: parameter shards on the host between uses too"""
    shard_params: bool = True
    """Gemini static: parameters sharded (``False``: ``shard_param_frac=0.0``, ZeRO-2-like)"""
    reshard: bool = True
    """FSDP: reshard parameters after forward (``FULL_SHARD``; ``False``: ``SHARD_GRAD_OP``)"""
    sp: bool = False
    """Megatron sequence parallelism over the tensor-parallel group"""
    microbatches: int = 1
    """pipeline micro-batches per step"""
    checkpointing: bool = False
    """activation checkpointing of every block"""

    @property
    def world_size(self) -> int:
        """Ranks the layout uses."""
        return self.dp * self.tp * self.pp

    @property
    def name(self) -> str:
        """A short label, e.g. ``hybrid tp2 pp2 dp2 zero1``."""
        parts = [self.plugin]
        if self.plugin == "zero":
            parts.append(f"stage{self.zero_stage}")
        if self.plugin == "gemini":
            parts.append(self.placement)
            if not self.shard_params:
                parts.append("replicated")
            if self.offload_param:
                parts.append("offload-params")
        if self.plugin == "fsdp" and not self.reshard:
            parts.append("shard-grad-op")
        if self.plugin == "hybrid":
            parts += [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
            parts += [f"zero{self.zero_stage}"] if self.zero_stage else []
            parts += ["sp"] if self.sp else []
        if self.offload:
            parts.append("offload")
        if self.checkpointing:
            parts.append("ckpt")
        return " ".join(parts)

    @property
    def complexity(self) -> int:
        """How involved the layout is (lower is simpler)."""
        return COMPLEXITY[self.plugin] + self.offload + self.offload_param

    def plugin_call(self) -> str:
        """The plugin's constructor call, as Python source."""
        p = f'precision="{self.precision}"'
        if self.plugin == "ddp":
            return "TorchDDPPlugin()"
        if self.plugin == "zero":
            extra = ", cpu_offload=True" if self.offload else ""
            return f"LowLevelZeroPlugin(stage={self.zero_stage}, {p}{extra})"
        if self.plugin == "gemini":
            args = [f'placement_policy="{self.placement}"']
            if self.placement == "static":
                if not self.shard_params:
                    args.append("shard_param_frac=0.0")
                if self.offload:
                    args.append("offload_optim_frac=1.0")
                if self.offload_param:
                    args.append("offload_param_frac=1.0")
            return f"GeminiPlugin({', '.join([*args, p])})"
        if self.plugin == "fsdp":
            args = [p]
            if not self.reshard:
                args.append('sharding_strategy="SHARD_GRAD_OP"')
            if self.offload:
                args.append("cpu_offload=True")
            return f"TorchFSDPPlugin({', '.join(args)})"
        args = [f"tp_size={self.tp}", f"pp_size={self.pp}"]
        if self.pp > 1:
            args.append(f"num_microbatches={self.microbatches}")
        if self.zero_stage:
            args.append(f"zero_stage={self.zero_stage}")
        if self.sp:
            args.append("enable_sequence_parallelism=True")
        if self.offload:
            args.append("cpu_offload=True")
        return f"HybridParallelPlugin({', '.join([*args, p])})"

    def booster_call(self) -> str:
        """The ``Booster(...)`` call around :meth:`plugin_call`."""
        if self.plugin == "ddp" and self.precision != "fp32":
            return f'Booster(plugin={self.plugin_call()}, mixed_precision="{self.precision}")'
        return f"Booster(plugin={self.plugin_call()})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_sizes(shape: ModelShape, nproc: int) -> list[int]:
    """Tensor-parallel sizes within one node that divide the heads, KV heads and MLP width."""
    return [
        t
        for t in _divisors(nproc)
        if shape.heads % t == 0 and shape.kv_heads % t == 0 and shape.intermediate % t == 0
    ]


def _microbatches(pp: int, batch: int) -> int:
    """Micro-batches of a pipeline step: the most that divide the per-replica batch, up to
    ``4 * pp`` (1F1B keeps at most ``pp`` in flight, so more of them shrink both the bubble and
    the activations of each)."""
    return max(m for m in _divisors(batch) if m <= 4 * pp)


def candidate_layouts(
    shape: ModelShape, nproc: int, nnodes: int, batch: int, precision: str
) -> list[Layout]:
    """Every layout the planner estimates for ``nproc * nnodes`` ranks and a global batch of
    ``batch`` sequences (layouts whose data-parallel size does not divide the batch are left
    out), each with and without activation checkpointing."""
    world = nproc * nnodes
    base: list[Layout] = []
    p = precision
    if batch % world == 0:
        base.append(Layout(plugin="ddp", precision=p, dp=world))
        for stage in (1, 2):
            for off in (False, True):
                base.append(Layout(plugin="zero", precision=p, dp=world, zero_stage=stage,
                                   offload=off))  # fmt: skip
        gem = Layout(plugin="gemini", precision=p, dp=world, zero_stage=3)
        base += [
            gem,
            replace(gem, shard_params=False),
            replace(gem, offload=True),
            replace(gem, offload=True, offload_param=True),
            replace(gem, placement="auto"),
        ]
        for reshard in (True, False):
            for off in (False, True):
                base.append(Layout(plugin="fsdp", precision=p, dp=world, zero_stage=3,
                                   reshard=reshard, offload=off))  # fmt: skip
    for tp in _tp_sizes(shape, nproc):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if (tp == 1 and pp == 1) or pp > shape.num_layers or batch % dp:
                continue
            m = _microbatches(pp, batch // dp) if pp > 1 else 1
            for zero in (0, 1) if dp > 1 else (0,):
                for sp in (False, True) if tp > 1 and pp == 1 else (False,):
                    base.append(Layout(plugin="hybrid", precision=p, dp=dp, tp=tp, pp=pp,
                                       zero_stage=zero, sp=sp, microbatches=m))  # fmt: skip
    out = []
    for layout in base:
        out.append(layout)
        if layout.pp == 1:  # checkpointing through HF's gradient_checkpointing_enable
            out.append(replace(layout, checkpointing=True))
    return out
