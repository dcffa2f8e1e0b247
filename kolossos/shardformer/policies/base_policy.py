"""Declarative tensor-parallel plans: which modules become which parallel layers.

A :class:`ModelPlan` describes one model instance: the model-level layers (embeddings, LM head),
one :class:`BlockPlan` applied to every repeated block, the size checks that must pass before
anything is sharded, where sequence parallelism splits and gathers the hidden states, and the
:class:`StageLayout` a pipeline splitter needs. A :class:`Policy` builds the plan from the model
(paths and sizes depend on the model class and its config). Plans are data: the sharder
(:mod:`kolossos.shardformer.sharder`) validates and applies them.

Paths are dotted sub-module names (``"attn.c_attn"``), relative to the model for model-level
entries and to one block for block entries.

Example:
    >>> plan = ModelPlan(
    ...     family="my-mlp-model",
    ...     layout=StageLayout(embeddings=("embed",), blocks="layers", final=("head",)),
    ...     block=BlockPlan(
    ...         layers=(ParallelLayer(path="up", style="column"),
    ...                 ParallelLayer(path="down", style="row")),
    ...         regions=(TPRegion(path="up", arg="input"),),
    ...         sequence_norms=("norm",),
    ...     ),
    ... )
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

__all__ = [
    "LAYER_STYLES",
    "BlockPlan",
    "Divisible",
    "LayerStyle",
    "LocalAttribute",
    "ModelPlan",
    "ParallelLayer",
    "Policy",
    "SequenceBoundary",
    "StageLayout",
    "TPRegion",
]

LayerStyle = Literal["column", "fused_column", "row", "vocab_embedding", "embedding", "lm_head"]
LAYER_STYLES: tuple[str, ...] = (
    "column",
    "fused_column",
    "row",
    "vocab_embedding",
    "embedding",
    "lm_head",
)
"""``column``: output features split (``Linear1D_Col``); ``fused_column``: several output blocks
stacked in one weight, each split (``FusedLinear1D_Col``, e.g. GPT-2's ``c_attn``); ``row``:
input features split, partial outputs summed (``Linear1D_Row``); ``vocab_embedding``: rows of the
vocabulary split (``VocabParallelEmbedding1D``); ``embedding``: embedding columns split
(``Embedding1D``); ``lm_head``: the output vocabulary split (``VocabParallelLMHead1D``)."""


def _check_path(owner: str, path: str) -> None:
    if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
        raise ValueError(
            f"{owner}: path={path!r} must be a dotted sub-module name such as 'attn.c_attn'."
        )


@dataclass(frozen=True, kw_only=True)
class ParallelLayer:
    """One sub-module replaced by a tensor-parallel layer."""

    path: str
    """Dotted name of the module to replace."""
    style: LayerStyle
    """Which parallel layer (see :data:`LAYER_STYLES`)."""
    fused_sections: tuple[int, ...] | None = None
    """``fused_column`` only: sizes of the stacked output blocks in the full weight (q, k, v)."""
    seq_dim: int = 1
    """``row`` under sequence parallelism: the sequence dimension its output is reduce-scattered
    along (0 for layers fed flattened ``(tokens, hidden)`` activations, as in OPT's MLP)."""

    def __post_init__(self) -> None:
        _check_path("ParallelLayer", self.path)
        if self.style not in LAYER_STYLES:
            raise ValueError(
                f"ParallelLayer({self.path!r}): style={self.style!r} is unknown; pick one of "
                f"{LAYER_STYLES}."
            )
        if (self.style == "fused_column") != (self.fused_sections is not None):
            raise ValueError(
                f"ParallelLayer({self.path!r}): fused_sections={self.fused_sections} must be "
                "given exactly for style='fused_column' (the sizes of the stacked blocks)."
            )
        if self.fused_sections is not None and any(s <= 0 for s in self.fused_sections):
            raise ValueError(
                f"ParallelLayer({self.path!r}): fused_sections={self.fused_sections} must be "
                "positive sizes."
            )


@dataclass(frozen=True, kw_only=True)
class TPRegion:
    """A module whose input enters a tensor-parallel region (Megatron's *f*).

    The column layers inside the region (paths below :attr:`path`, or the module itself) do no
    communication of their own; the region's entry does it once for all of them: without
    sequence parallelism an identity whose gradient is all-reduced, with it an all-gather along
    the sequence whose gradient is reduce-scattered. Modules that read the batch and sequence
    sizes from their input (most attention forwards) must therefore be a region as a whole.
    """

    path: str
    """Dotted name of the module whose forward input is the region input."""
    arg: str = "hidden_states"
    """Name of the forward argument carrying the activations (passed by name or first)."""
    seq_dim: int = 1
    """Sequence dimension of that argument (gathered under sequence parallelism)."""

    def __post_init__(self) -> None:
        _check_path("TPRegion", self.path)
        if not self.arg.isidentifier():
            raise ValueError(f"TPRegion({self.path!r}): arg={self.arg!r} must be an identifier.")


@dataclass(frozen=True, kw_only=True)
class LocalAttribute:
    """An attribute the module's forward reads that must become its per-rank value."""

    path: str
    """Dotted name of the attribute, e.g. ``"attn.num_heads"``."""
    full: int
    """Its value in the unsharded model; checked, then replaced by ``full // tp_size``."""

    def __post_init__(self) -> None:
        _check_path("LocalAttribute", self.path)
        if "." not in self.path and not self.path.isidentifier():
            raise ValueError(f"LocalAttribute: path={self.path!r} must name an attribute.")


@dataclass(frozen=True, kw_only=True)
class Divisible:
    """A size the tensor-parallel size must divide (checked before anything is sharded)."""

    name: str
    """What the size is, as the user knows it (``"num_key_value_heads"``)."""
    value: int
    """The size."""


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """What happens inside each repeated block (attention + MLP)."""

    layers: tuple[ParallelLayer, ...]
    """Layers to replace, paths relative to the block."""
    regions: tuple[TPRegion, ...] = ()
    """Entries of the tensor-parallel regions; every column layer must lie inside one."""
    attributes: tuple[LocalAttribute, ...] = ()
    """Head counts and widths the forward reads, made local."""
    sequence_norms: tuple[str, ...] = ()
    """Replicated modules (norms) that run on sequence shards under sequence parallelism: their
    parameters are marked so their gradients are all-reduced over the group."""
    parallel_rng: tuple[str, ...] = ()
    """Modules whose dropout acts on head-sharded activations (attention): without sequence
    parallelism their forward runs on the per-rank RNG state. Under sequence parallelism the
    whole block runs on it (every activation in a block is sharded then)."""
    replicated_rng: tuple[str, ...] = ()
    """Dropouts nested in a :attr:`parallel_rng` module that act on replicated activations
    (GPT-2's ``resid_dropout``, after the all-reduced ``c_proj``): without sequence parallelism
    the per-rank state is left while they run, so every rank draws the same mask."""
    replicated_params: tuple[str, ...] = ()
    """Modules with replicated parameters that see full (gathered) activations: their gradients
    are already complete, nothing is marked. Every parameter of a block must be sharded, in
    :attr:`sequence_norms`, or here; the sharder checks it."""


@dataclass(frozen=True, kw_only=True)
class SequenceBoundary:
    """Where the hidden states enter and leave the sequence-parallel part of the model.

    They are split along the sequence at the input of the first block and gathered at the
    output of :attr:`gather_after` (the last block or the final norm), before any head.
    """

    gather_after: str
    """Dotted name of the module whose output is all-gathered along the sequence."""
    split_arg: str = "hidden_states"
    """Name of the first block's forward argument carrying the hidden states."""
    seq_dim: int = 1
    """Sequence dimension of the hidden states."""
    norms: tuple[str, ...] = ()
    """Model-level replicated modules between the last block and the gather point (the final
    norm): marked like :attr:`BlockPlan.sequence_norms`."""


@dataclass(frozen=True, kw_only=True)
class StageLayout:
    """The model's stages in execution order, for a pipeline splitter."""

    embeddings: tuple[str, ...]
    """Modules that run before the blocks (token/position embeddings, embedding norm)."""
    blocks: str
    """Dotted name of the ``nn.ModuleList`` of repeated blocks."""
    final: tuple[str, ...] = ()
    """Modules that run after the blocks (final norm, pooler, heads)."""
    tied: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names that the model may tie (the same ``Parameter``); a group is
    reported (and kept tied after sharding) only when the model really ties it."""

    def __post_init__(self) -> None:
        _check_path("StageLayout.blocks", self.blocks)
        for path in (*self.embeddings, *self.final):
            _check_path("StageLayout", path)


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """The whole tensor-parallel plan of one model."""

    family: str
    """Name shown in messages (``"gpt2"``)."""
    layout: StageLayout
    """Embeddings, blocks, final modules and tied weights."""
    block: BlockPlan
    """Applied to every module of :attr:`StageLayout.blocks`."""
    layers: tuple[ParallelLayer, ...] = ()
    """Model-level layers (embeddings, LM head), paths relative to the model."""
    divisible: tuple[Divisible, ...] = ()
    """Sizes the tensor-parallel size must divide (heads, KV heads, MLP width...)."""
    sequence: SequenceBoundary | None = None
    """Where sequence parallelism splits and gathers; ``None``: the plan does not support it."""
    causal_lm_loss: bool = False
    """The model computes its loss with ``self.loss_function(logits, labels, ...)`` (transformers'
    causal-LM loss): with a vocabulary-parallel head and ``parallel_output`` that loss is replaced
    by a vocabulary-parallel one. When ``False`` a vocabulary-parallel head gathers its logits."""
    notes: tuple[str, ...] = field(default=())
    """Free-form remarks shown by ``describe()`` (what stays replicated and why)."""

    def describe(self) -> str:
        """A human-readable summary of the plan."""
        lines = [f"plan {self.family}: blocks at {self.layout.blocks!r}"]
        lines += [f"  model  {layer.path}: {layer.style}" for layer in self.layers]
        lines += [f"  block  {layer.path}: {layer.style}" for layer in self.block.layers]
        lines += [f"  local  {a.path} = {a.full} / tp" for a in self.block.attributes]
        lines += [f"  note   {note}" for note in self.notes]
        return "\n".join(lines)


class Policy(ABC):
    """Builds the :class:`ModelPlan` of a model; subclass it to shard a model of your own.

    Example:
        >>> class MyPolicy(Policy):
        ...     def plan(self, model):
        ...         return ModelPlan(family="mine", layout=..., block=...)  # doctest: +SKIP
    """

    @abstractmethod
    def plan(self, model: nn.Module) -> ModelPlan:
        """The plan for ``model`` (read sizes from its config or modules; do not modify it)."""
