"""Attention-level sequence parallelism for the ShardFormer plans (Colossal-AI's
``sequence_parallelism_mode='all_to_all'`` and ``'ring_attn'``).

Every rank of the sequence-parallel (SP) group receives the same whole batch. A forward
pre-hook on the model cuts this rank's sequence shard of every per-token input
(``input_ids``, ``inputs_embeds``, ``token_type_ids``, the padding ``attention_mask``) and passes
the global ``position_ids`` of the shard, so learned and rotary positions are right:

* ``'all_to_all'`` (Ulysses): contiguous shards, attention by
  :func:`~kolossos.sequence.ulysses_attention` (sequence shards <-> head shards);
* ``'ring_attn'``: zig-zag shards (:func:`~kolossos.sequence.zigzag_split`; causal work
  balanced), attention by :func:`~kolossos.sequence.ring_attention`.

The attention goes through transformers' attention interface: the model's
``config._attn_implementation`` is set to ``'kolossos_ulysses'`` / ``'kolossos_ring'``, two
functions registered here (they build no mask: causality comes from the attention module's
``is_causal``, padding from the shard of ``attention_mask``). With tensor parallelism the heads
are split by TP first and the kernels work on the rank's local heads.

Loss: ``labels`` are taken out of the model call; causal-LM labels are shifted on the whole
sequence first (so no target is lost at a shard boundary), then sharded like the inputs. A
forward hook computes the summed token loss of the shard from the logits (vocabulary-parallel
with a vocabulary-parallel head) and divides it by the target count of the whole batch
(all-reduced over SP). The returned ``loss`` equals the single-process mean on every rank; its
gradient is ``sp_size`` times the shard's share, so the mean taken by the data-parallel
reduction over ``dp x sp`` gives the exact gradient. The returned ``logits`` are the rank's
sequence shard (in the shard's token order).

Which families, task models and pooled heads are covered, and their own hooks (OPT positions,
ViT's cut after the embeddings, the pooled heads' token pick): :mod:`kolossos.hybrid.sp_families`.

With pipeline parallelism (:func:`install_stage_sequence_parallel`) the model itself gets no
hooks; the stage chunks do the same work: the first stage cuts each micro-batch's shard (inputs,
``position_ids``, the padding-mask and label shards, all carried to the later stages with the
``(micro-batch, S / sp, H)`` hidden-state shard), every stage hands its mask shard to the
attention, and the last stage computes the shard's loss with the micro-batch's whole target
count, as above. The family work (OPT positions, ViT's cut and mask, the pooled heads' token
pick with whole per-sample labels) is done per micro-batch by
:class:`~kolossos.hybrid.sp_families.StageFamily` on the stage that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kolossos.hybrid.sp_families import StageFamily, install_family_hooks, model_support
from kolossos.nn.layer.parallel_1d import vocab_parallel_cross_entropy
from kolossos.sequence import ring_attention, split_sequence, ulysses_attention
from kolossos.sequence.zigzag import sequence_positions
from kolossos.shardformer.pipeline import stage_of
from kolossos.shardformer.policies.base_policy import ModelPlan
from kolossos.shardformer.validate import block_list

__all__ = [
    "ATTENTION_MODES",
    "SP_ATTENTION",
    "SequenceParallelContext",
    "install_sequence_parallel",
    "install_stage_sequence_parallel",
]

ATTENTION_MODES = ("all_to_all", "ring_attn")
"""The attention-level modes this module implements."""

SP_ATTENTION = {"all_to_all": "kolossos_ulysses", "ring_attn": "kolossos_ring"}
"""transformers attention-implementation names registered for each mode."""

# the families, task models and pooled heads covered: the tables of sp_families
_CTX_ATTR = "_kolossos_sp_context"
_PER_TOKEN = ("input_ids", "inputs_embeds", "token_type_ids")


@dataclass(eq=False)
class SequenceParallelContext:
    """The SP group and the current (micro-batch's) padding-mask shard, shared by the attention
    calls; a checkpointed block replays with the shard of its own forward
    (:meth:`checkpoint_contexts`)."""

    group: dist.ProcessGroup
    mode: str
    key_padding_mask: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    causal_lm: bool | None = None
    """``True``: a causal LM (labels shifted), ``False``: a masked LM, ``None``: no loss."""
    loss: _LossHook | None = None
    """Computes the shard's loss of an LM (``None`` for a base model)."""
    family: StageFamily | None = None
    """The family hooks of the pipeline stages (``None`` without a pipeline)."""

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def layout(self) -> str:
        return "zigzag" if self.mode == "ring_attn" else "contiguous"

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``x`` along dimension 1 (the sequence)."""
        return split_sequence(x, 1, self.rank, self.size, self.layout)  # type: ignore[arg-type]

    @staticmethod
    def of(model: nn.Module) -> SequenceParallelContext | None:
        """The context :func:`install_sequence_parallel` gave ``model`` (``None``: none)."""
        ctx = getattr(model, _CTX_ATTR, None)
        return ctx if isinstance(ctx, SequenceParallelContext) else None

    @contextmanager
    def masking(self, mask: torch.Tensor | None) -> Iterator[None]:
        """The attention calls inside see padding-mask shard ``mask``; the previous one after."""
        saved, self.key_padding_mask = self.key_padding_mask, mask
        try:
            yield
        finally:
            self.key_padding_mask = saved

    def checkpoint_contexts(
        self,
    ) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        """``context_fn`` of ``torch.utils.checkpoint`` (non-reentrant), called when a
        checkpointed block runs forward: the forward as it is, and its recomputation in a later
        backward with the mask shard of *this* micro-batch, captured now. Under a pipeline
        schedule other micro-batches' forwards (with their own masks) run in between."""
        return nullcontext(), self.masking(self.key_padding_mask)


def _attention(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    ctx: SequenceParallelContext | None = getattr(module, _CTX_ATTR, None)
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__} uses kolossos sequence-parallel attention but was not "
            "prepared by HybridParallelPlugin(sp_size=...); shard the model with the plugin."
        )
    causal = bool(getattr(module, "is_causal", False))
    mask = ctx.key_padding_mask
    if ctx.mode == "all_to_all":
        out = ulysses_attention(
            q, k, v, ctx.group, causal=causal, key_padding_mask=mask, dropout_p=dropout,
            scale=scaling,
        )  # fmt: skip
    else:
        if dropout:
            raise NotImplementedError(
                "sequence_parallelism_mode='ring_attn' with attention dropout > 0: ring "
                "attention has no dropout; set the model's attention dropout to 0 or use "
                "'all_to_all'."
            )
        out = ring_attention(
            q, k, v, ctx.group, causal=causal, key_padding_mask=mask, scale=scaling,
            layout="zigzag",
        )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    for name in SP_ATTENTION.values():
        AttentionInterface.register(name, _attention)


def _shard_inputs(
    ctx: SequenceParallelContext, kwargs: dict[str, Any], causal_lm: bool | None
) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    """This rank's shard of the per-token inputs with the global ``position_ids`` of the shard;
    the padding mask's shard and the labels' (causal LM: shifted on the whole sequence first)
    are returned apart: ``(inputs without attention_mask / labels, mask shard, label shard)``."""
    ids = kwargs.get("input_ids")
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    if ref is None:
        raise ValueError("sequence parallelism needs input_ids or inputs_embeds as keywords.")
    batch, seq = ref.shape[0], ref.shape[1]
    if seq % (ctx.size * (2 if ctx.layout == "zigzag" else 1)):
        raise ValueError(
            f"sequence length {seq} is not divisible by "
            f"{'2 x ' if ctx.layout == 'zigzag' else ''}sp_size={ctx.size} "
            f"(sequence_parallelism_mode={ctx.mode!r}); pad the batch to a multiple."
        )
    if kwargs.get("past_key_values") is not None:
        raise NotImplementedError("sequence parallelism with past_key_values (a KV cache).")
    out = dict(kwargs)
    for name in _PER_TOKEN:
        if out.get(name) is not None:
            out[name] = ctx.split(out[name])
    pos = out.get("position_ids")
    if pos is None:
        pos = sequence_positions(seq, ctx.rank, ctx.size, ctx.layout)  # type: ignore[arg-type]
        pos = pos.to(ref.device).unsqueeze(0).expand(batch, -1)
    else:
        pos = ctx.split(pos)
    out["position_ids"] = pos
    mask = out.pop("attention_mask", None)
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                "sequence parallelism takes a (batch, seq) padding attention_mask, got shape "
                f"{tuple(mask.shape)}."
            )
        mask = ctx.split(mask)
    labels = out.pop("labels", None)
    if labels is not None:
        if causal_lm:  # tokens < n predict n, on the whole sequence, before sharding
            labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        labels = ctx.split(labels)
    return out, mask, labels


def _split_inputs(
    ctx: SequenceParallelContext, kwargs: dict[str, Any], causal_lm: bool | None
) -> dict[str, Any]:
    out, mask, labels = _shard_inputs(ctx, kwargs, causal_lm)
    ctx.key_padding_mask = None if mask is None else mask.bool()
    out["attention_mask"] = None
    if "use_cache" in out or causal_lm is not None:
        out["use_cache"] = False
    ctx.targets = labels
    return out


class _LossHook:
    def __init__(self, ctx: SequenceParallelContext, vocab_size: int,
                 tp_group: dist.ProcessGroup | None) -> None:  # fmt: skip
        self.ctx, self.vocab_size, self.tp_group = ctx, vocab_size, tp_group

    def __call__(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        targets, self.ctx.targets = self.ctx.targets, None
        return output if targets is None else self.loss(output, targets)

    def loss(self, output: Any, targets: torch.Tensor) -> Any:
        """``output`` with ``loss`` set from its (sharded) ``logits`` and the shard's
        ``targets`` (a collective over the SP group)."""
        ctx = self.ctx
        logits = output.logits.float()
        targets = targets.to(logits.device)
        if self.tp_group is not None:  # vocabulary-parallel logits
            total = vocab_parallel_cross_entropy(
                logits, targets, self.tp_group, vocab_size=self.vocab_size, reduction="sum"
            )
        else:
            total = F.cross_entropy(
                logits[..., : self.vocab_size].reshape(-1, self.vocab_size),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
        stats = torch.stack([total.detach(), (targets != -100).sum().to(total.dtype)])
        dist.all_reduce(stats, group=ctx.group)  # COLLECTIVE over the SP group
        local = total * ctx.size / stats[1]
        output.loss = local + (stats[0] / stats[1] - local).detach()
        return output


def _check_heads(plan: ModelPlan, sp: int, tp: int) -> None:
    """Ulysses splits the heads left after tensor parallelism over the SP group.

    Raises:
        ValueError: the query heads per TP rank are not divisible by ``sp`` (or the KV heads
            neither divisible by it nor dividing it).
    """
    for item in plan.divisible:
        if "heads" not in item.name:
            continue
        local = item.value // tp
        kv = "key_value" in item.name
        if local % sp and not (kv and sp % local == 0):
            raise ValueError(
                f"sequence_parallelism_mode='all_to_all' with sp_size={sp} and tp_size={tp}: "
                f"{item.name}={item.value} leaves {local} heads per tensor-parallel rank, not "
                f"divisible by sp_size={sp}; choose sp_size * tp_size dividing the heads, or "
                "sequence_parallelism_mode='ring_attn' (no head constraint)."
            )


def install_sequence_parallel(
    model: nn.Module,
    plan: ModelPlan,
    group: dist.ProcessGroup,
    mode: str,
    vocab_parallel_group: dist.ProcessGroup | None,
    tp_size: int = 1,
    pipeline: bool = False,
) -> SequenceParallelContext:
    """Make ``model`` (already tensor-parallel or not) run with its sequence split over
    ``group`` in ``mode`` (module doc). No communication.

    Args:
        vocab_parallel_group: the TP group when the LM head's logits stay vocabulary-parallel,
            else ``None``.
        tp_size: the tensor-parallel size the heads were split by already.
        pipeline: the model will be cut into pipeline stages: no hooks on the model itself
            (:func:`install_stage_sequence_parallel` wraps the stage chunks instead).

    Raises:
        NotImplementedError: a family, model class or mode the hooks do not cover (named).
        ValueError: Ulysses cannot split the heads (:func:`_check_heads`).
    """
    if mode not in ATTENTION_MODES:
        raise NotImplementedError(
            f"sequence_parallelism_mode={mode!r} is not implemented here; use one of "
            f"{ATTENTION_MODES} (or 'split_gather' over the TP group)."
        )
    support = model_support(model, plan, mode)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise NotImplementedError(f"{type(model).__name__} has no transformers config.")
    if mode == "all_to_all":
        _check_heads(plan, dist.get_world_size(group), tp_size)
    _register()
    ctx = SequenceParallelContext(group=group, mode=mode)
    for block in block_list(model, plan):
        setattr(block.get_submodule(support.attention_path), _CTX_ATTR, ctx)
    setter: Callable[[str], None] | None = getattr(model, "set_attn_implementation", None)
    try:
        if callable(setter):
            setter(SP_ATTENTION[mode])
        else:
            raise AttributeError
    except Exception:  # older transformers or a refused name: the modules read the config
        config._attn_implementation = SP_ATTENTION[mode]
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = SP_ATTENTION[mode]

    lm = support.causal_lm
    ctx.causal_lm = lm
    if lm is not None:
        head_group = vocab_parallel_group if lm else None
        ctx.loss = _LossHook(ctx, int(config.vocab_size), head_group)
    setattr(model, _CTX_ATTR, ctx)
    if pipeline:
        ctx.family = StageFamily(ctx, support, config, plan.layout.embeddings[0])
        return ctx
    install_family_hooks(model, plan, ctx, support, _split_inputs)
    if ctx.loss is not None:
        model.register_forward_hook(ctx.loss, with_kwargs=True)
    return ctx


class _FirstStage:
    """The call of a first-stage chunk: cuts the micro-batch's sequence shard before the stage
    runner sees it, so the shard's inputs, positions, padding-mask and label shards travel
    with the hidden-state shard to the later stages."""

    def __init__(
        self, ctx: SequenceParallelContext, family: StageFamily, runner: Callable[..., Any]
    ) -> None:
        self.ctx, self.family, self.runner = ctx, family, runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError(
                "a sequence-parallel pipeline takes its micro-batches as dicts of keywords "
                "({'input_ids': ..., 'attention_mask': ..., 'labels': ...})."
            )
        if self.family.support.image:  # the embeddings hook cuts the sequence it makes
            return self.runner(**kwargs)
        kwargs, whole = self.family.first_inputs(kwargs)
        inputs, mask, labels = _shard_inputs(self.ctx, kwargs, self.ctx.causal_lm)
        if mask is not None:
            inputs["attention_mask"] = mask
        if labels is not None:
            inputs["labels"] = labels
        if whole is not None:  # a pooled head's per-sample labels
            inputs["labels"] = whole
        return self.runner(**inputs)


class _StageForward:
    """The model forward a stage runner calls: takes the padding-mask shard out of the inputs
    (the attention reads it from the context) and the label shard (on the last stage the loss
    is computed here as in the single-stage path, else it only travelled through); the family
    hooks prepare the micro-batch (:meth:`StageFamily.before_stage`). A pooled head's whole
    labels go to the last stage's model, which computes its own loss."""

    def __init__(
        self,
        ctx: SequenceParallelContext,
        family: StageFamily,
        forward: Callable[..., Any],
        last: bool,
    ) -> None:
        self.ctx, self.family, self.forward, self.last = ctx, family, forward, last

    def __call__(self, **kwargs: Any) -> Any:
        mask = kwargs.pop("attention_mask", None)
        labels = kwargs.pop("labels", None)
        self.ctx.key_padding_mask = None if mask is None else mask.bool()
        self.family.before_stage({**kwargs, "attention_mask": mask}, self.last)
        if self.family.pooled and self.last and labels is not None:
            return self.forward(**kwargs, labels=labels, attention_mask=None)
        output = self.forward(**kwargs, attention_mask=None)
        if self.last and labels is not None and self.ctx.loss is not None:
            output = self.ctx.loss.loss(output, labels)
        return output


def install_stage_sequence_parallel(model: nn.Module, chunks: nn.ModuleList) -> None:
    """Sequence parallelism for the pipeline stage ``chunks`` of ``model`` (prepared by
    :func:`install_sequence_parallel` with ``pipeline=True``): the first stage cuts the shard,
    every stage hands the mask shard to the attention, the last computes the shard's loss.

    Raises:
        TypeError: a chunk not built by :func:`~kolossos.shardformer.pipeline.build_stage_chunk`.
    """
    ctx: SequenceParallelContext = getattr(model, _CTX_ATTR)
    family = ctx.family
    if family is None:
        raise TypeError(
            f"{type(model).__name__} was not prepared for pipeline stages; call "
            "install_sequence_parallel(..., pipeline=True) first."
        )
    family.install(model)
    for chunk in chunks:
        stage, runner = stage_of(chunk), cast(Any, chunk.forward)
        if stage is None or not hasattr(runner, "forward"):
            raise TypeError(f"{type(chunk).__name__} is not a pipeline stage chunk.")
        runner.forward = _StageForward(ctx, family, runner.forward, stage.last)
        if stage.first:
            object.__setattr__(chunk, "forward", _FirstStage(ctx, family, runner))
