"""The part of a model one rank holds: tensor-parallel shards of the blocks of its pipeline
stage (plus the embeddings on the first stage and the head on the last), as sizes.

Example:
    >>> from kolossos.utils.profiling.model_shape import load_model_shape
    >>> ranks = rank_models(load_model_shape("gpt2-tiny"), tp_size=1, pp_size=2)
    >>> [r.layers for r in ranks], ranks[1].tied_copy  # the last stage holds a copy of wte
    ([1, 1], True)
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.utils.profiling.model_params import ParamSpec, local_numel, parameter_specs
from kolossos.utils.profiling.model_shape import ModelShape

__all__ = ["RankModel", "rank_models", "stage_layer_counts"]


@dataclass(frozen=True, kw_only=True)
class RankModel:
    """Parameter sizes (elements) on one rank."""

    stage: int
    """pipeline stage (0 without pipeline parallelism)"""
    numel: int
    """every parameter element this rank holds (a tied copy included)"""
    largest: int
    """the largest tensor"""
    layers: int
    """blocks on this rank"""
    layer_numel: int
    """elements of one block"""
    layer_largest: int = 0
    """the largest tensor of a block"""
    embed_numel: int
    """elements of the embeddings (0 off the first stage)"""
    head_numel: int
    """elements used after the blocks: final norm, untied head or a tied copy (0 off the last)"""
    tied_numel: int
    """elements of the embedding the output head shares (0 when untied or not held here)"""
    has_embed: bool
    """the first stage"""
    has_head: bool
    """the last stage"""
    tied_copy: bool = False
    """the last stage of a pipeline holds its own copy of a tied embedding"""
    sizes: tuple[int, ...] = ()
    """every tensor's local size, in registration order"""
    tied_index: int = -1
    """index into :attr:`sizes` of the embedding the output head shares (-1: none here); Gemini
    packs it alone in a chunk"""
    head_tensors: int = 0
    """tensors used after the blocks (their gradients arrive first)"""
    block_tensors: int = 0
    """tensors of one block"""
    arrival: tuple[int, ...] = ()
    """indices into :attr:`sizes` in the order backward finishes their gradients: the head's
    (last registered first), the blocks' from the last block to the first, the embeddings'"""


def stage_layer_counts(num_layers: int, pp_size: int) -> list[int]:
    """Blocks per pipeline stage: as even as possible, the last stages take the remainder
    (``PipelineStageManager.distribute_layers``)."""
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if s >= pp_size - extra else 0) for s in range(pp_size)]


def rank_models(
    shape: ModelShape, tp_size: int = 1, pp_size: int = 1, vocab_divisible_by: int = 64
) -> list[RankModel]:
    """One :class:`RankModel` per pipeline stage (a tensor-parallel rank's share).

    Raises:
        ValueError: fewer blocks than pipeline stages.
    """
    if shape.num_layers < pp_size:
        raise ValueError(
            f"{shape.num_layers} blocks cannot fill pp_size={pp_size} stages; use pp_size <= "
            f"{shape.num_layers}."
        )
    specs = parameter_specs(shape)
    local = [local_numel(spec, tp_size, vocab_divisible_by) for spec in specs]
    counts = stage_layer_counts(shape.num_layers, pp_size)
    tied = shape.tied_embeddings and shape.family != "vit"
    return [
        _stage(specs, local, s, sum(counts[:s]), counts[s], pp_size, tied) for s in range(pp_size)
    ]


def _stage(
    specs: list[ParamSpec], local: list[int], s: int, lo: int, layers: int, pp: int, tied: bool
) -> RankModel:
    """Stage ``s`` of ``pp``, holding blocks ``[lo, lo + layers)``."""
    first, last = s == 0, s == pp - 1
    sizes: list[int] = []
    order: list[tuple[int, int, int]] = []  # (segment's turn in backward, -layer, -index)
    embed = head = layer_numel = layer_largest = 0
    tied_index = -1
    word = next((n for sp, n in zip(specs, local, strict=True) if sp.tp == "vocab"), 0)
    for spec, n in zip(specs, local, strict=True):
        if spec.segment == "layer":
            if spec.layer == lo:
                layer_numel += n
                layer_largest = max(layer_largest, n)
            if not lo <= spec.layer < lo + layers:
                continue
            order.append((1, -spec.layer, -len(sizes)))
        elif spec.segment == "embed" and first:
            embed += n
            if tied and last and spec.tp == "vocab" and tied_index < 0:
                tied_index = len(sizes)
            order.append((2, 0, -len(sizes)))
        elif spec.segment == "head" and last:
            head += n
            order.append((0, 0, -len(sizes)))
        else:
            continue
        sizes.append(n)
    copy = tied and last and not first
    if copy:  # the last stage keeps its own copy of the tied word embedding
        order.append((0, -1, -len(sizes)))  # used last in forward: its gradient comes first
        sizes.append(word)
    tied_here = word if (tied and last) else 0
    return RankModel(
        stage=s,
        numel=sum(sizes),
        largest=max(sizes, default=0),
        layers=layers,
        layer_numel=layer_numel,
        layer_largest=layer_largest,
        embed_numel=embed,
        head_numel=head + tied_here,
        tied_numel=tied_here,
        has_embed=first,
        has_head=last,
        tied_copy=copy,
        sizes=tuple(sizes),
        tied_index=tied_index,
        head_tensors=sum(1 for key in order if key[0] == 0),
        block_tensors=sum(1 for key in order if key[0] == 1 and key[1] == -lo),
        arrival=tuple(-key[2] for key in sorted(order)),
    )
