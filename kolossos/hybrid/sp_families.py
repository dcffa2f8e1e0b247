"""The model families and heads attention-level sequence parallelism covers (``'all_to_all'`` /
``'ring_attn'``, :mod:`kolossos.hybrid.sequence_parallel`), and the hooks they need beyond
cutting the per-token inputs.

* Tables: the attention module of each family (:data:`ATTENTION_PATH`), the task models with a
  token loss (:data:`LM_CLASSES`), the base models (:data:`BASE_CLASSES`) and the pooled heads
  (:data:`POOLED_HEADS`). :func:`model_support` reads them and refuses the rest by name.
* OPT: learned positions come from the whole padding mask (``cumsum(mask) * mask - 1``, as
  ``OPTDecoder`` computes them) before the split, so every token of the shard, padded ones
  included, gets its single-process position.
* ViT: the sequence (CLS token + patches, position embeddings added) is made inside the model,
  so a forward hook on the embeddings cuts it: padded at the end to a multiple of ``sp_size``
  (``2 * sp_size`` for the zig-zag layout), the padding masked as keys, this rank's shard kept.
* Pooled heads: the model runs sequence-parallel up to the head; the head's one token per
  sample (the first: BERT's pooler, ViT's CLS; the last non-pad token: GPT-2 / LLaMA / OPT
  sequence classification, found on the whole ``input_ids`` before the split) is taken on the
  rank holding it and summed over the SP group (:func:`pick_tokens`); the gradient is summed
  back, so the owner's encoder gets ``sp_size`` times its share, as the token losses do. The
  head then computes the model's own loss on the whole batch, the same on every SP rank.
* Pipeline stages (:class:`StageFamily`): the same work per micro-batch, each piece on the
  stage that needs it, from the inputs that travel with the hidden-state shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kolossos.sequence.zigzag import sequence_positions
from kolossos.shardformer.policies._common import is_class
from kolossos.shardformer.policies.base_policy import ModelPlan

if TYPE_CHECKING:
    from kolossos.hybrid.sequence_parallel import SequenceParallelContext

__all__ = [
    "ATTENTION_PATH",
    "BASE_CLASSES",
    "LM_CLASSES",
    "POOLED_HEADS",
    "ModelSupport",
    "PooledHead",
    "StageFamily",
    "install_family_hooks",
    "model_support",
    "pick_tokens",
]

ATTENTION_PATH = {
    "gpt2": "attn", "llama": "self_attn", "bert": "attention.self", "opt": "self_attn",
    "vit": "attention",
}  # fmt: skip
"""The attention module inside one block, per family (all call transformers'
``ALL_ATTENTION_FUNCTIONS`` with ``config._attn_implementation``)."""

LM_CLASSES = {
    "GPT2LMHeadModel": True, "LlamaForCausalLM": True, "OPTForCausalLM": True,
    "BertForMaskedLM": False,
}  # fmt: skip
"""Task models with a token-level loss the loss hook reproduces (``True``: causal LM, shifted
labels)."""

BASE_CLASSES = ("GPT2Model", "LlamaModel", "OPTModel", "BertModel", "ViTModel")
"""Base models (no loss; ``last_hidden_state`` is the rank's shard)."""

_IMAGE_FAMILIES = ("vit",)


@dataclass(frozen=True, kw_only=True)
class PooledHead:
    """Where a pooled head reads its one token per sample."""

    path: str
    """The module (below the model) that reads the pooled token."""
    reads: Literal["input", "output", "first_output"]
    """``"input"``: a pre-hook hands the module ``(B, 1, H)``, the pooled token, instead of the
    sequence shard (a pooler reading ``[:, 0]``); ``"output"``: a forward hook replaces every
    position of the module's per-token output ``(B, S / sp, C)`` by the pooled token's (a score
    layer the model then indexes at some local position); ``"first_output"``: the module saw the
    shard's first token ``(B, H)``; its output becomes the one of the sequence's first token."""
    token: Literal["first", "last_non_pad"]
    """The token: the sequence's first, or the last one not equal to ``pad_token_id`` (the last
    of the sequence without ``input_ids`` or ``pad_token_id``), as transformers picks it."""


_SCORE = PooledHead(path="score", reads="output", token="last_non_pad")
POOLED_HEADS = {
    "BertForSequenceClassification": PooledHead(path="bert.pooler", reads="input", token="first"),
    "ViTForImageClassification": PooledHead(path="classifier", reads="first_output", token="first"),
    "GPT2ForSequenceClassification": _SCORE,
    "LlamaForSequenceClassification": _SCORE,
    "OPTForSequenceClassification": _SCORE,
    # the base models' pooler_output
    "BertModel": PooledHead(path="pooler", reads="input", token="first"),
    "ViTModel": PooledHead(path="pooler", reads="input", token="first"),
}
"""Task models (and base models with a pooler) whose head reads one token per sample."""


@dataclass(frozen=True, kw_only=True)
class ModelSupport:
    """What :func:`install_family_hooks` installs for one model."""

    family: str
    """The plan's family."""
    attention_path: str
    """The attention module inside a block."""
    causal_lm: bool | None
    """``True``: causal LM, ``False``: masked LM, ``None``: no token loss."""
    head: PooledHead | None
    """The pooled head, if any (``None`` also where the base model has no pooler)."""

    @property
    def image(self) -> bool:
        """The sequence is made inside the model (ViT): cut after the embeddings."""
        return self.family in _IMAGE_FAMILIES


def model_support(model: nn.Module, plan: ModelPlan, mode: str) -> ModelSupport:
    """What ``model`` needs under sequence parallelism ``mode`` (the same with pipeline stages:
    :class:`StageFamily` does the per-micro-batch work there).

    Raises:
        NotImplementedError: a family, model class or combination not covered (named, with the
            alternative).
    """
    path = ATTENTION_PATH.get(plan.family)
    if path is None:
        raise NotImplementedError(
            f"sequence_parallelism_mode={mode!r} for the {plan.family!r} family: the attention "
            f"of {sorted(ATTENTION_PATH)} is replaced; use 'split_gather' (tp_size > 1)."
        )
    lm = next((v for k, v in LM_CLASSES.items() if is_class(model, k)), None)
    name = next((k for k in POOLED_HEADS if is_class(model, k)), None)
    if lm is None and name is None and not is_class(model, *BASE_CLASSES):
        raise NotImplementedError(
            f"sequence_parallelism_mode={mode!r} with {type(model).__name__}: covered are the "
            f"token losses of {sorted(LM_CLASSES)}, the pooled heads of "
            f"{sorted(k for k in POOLED_HEADS if k not in BASE_CLASSES)} and the base models "
            f"{list(BASE_CLASSES)}. Use 'split_gather' (tp_size > 1)."
        )
    head = None if name is None else POOLED_HEADS[name]
    if head is not None and _module_at(model, head.path) is None:
        head = None  # a base model built without its pooler
    if plan.family == "opt" and getattr(getattr(model, "config", None), "layerdrop", 0.0) > 0:
        raise NotImplementedError(
            "sequence parallelism with OPT's layerdrop > 0: each SP rank would drop layers on "
            "its own draw; set config.layerdrop=0."
        )
    return ModelSupport(family=plan.family, attention_path=path, causal_lm=lm, head=head)


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


class _SumOverGroup(torch.autograd.Function):
    """Sum over the group; the gradient is summed too (every rank uses the sum in the same
    computation, so the rank that contributed a value gets the whole batch of gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)  # SYNC POINT (SP group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)  # SYNC POINT (SP group)
        return out, None


def pick_tokens(
    x: torch.Tensor, positions: torch.Tensor, index: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Sample ``b``'s token at global position ``index[b]``, on every rank of ``group``.

    Args:
        x: ``(B, S_local, ...)``, this rank's shard.
        positions: ``(S_local,)``, the global position of each local token.
        index: ``(B,)``, the wanted global positions.

    Returns:
        ``(B, ...)``: the token from the rank that holds it (others contribute zeros).
    """
    hit = positions.to(x.device)[None, :] == index.to(x.device)[:, None]  # (B, S_local)
    local = hit.to(torch.int32).argmax(1)
    mine = x[torch.arange(x.shape[0], device=x.device), local]
    owned = hit.any(1).view(-1, *([1] * (mine.dim() - 1)))
    mine = torch.where(owned, mine, torch.zeros_like(mine))
    out: torch.Tensor = _SumOverGroup.apply(mine, group)
    return out


@dataclass(eq=False)
class _Step:
    """The current forward's global positions of the local tokens and the heads' token index."""

    positions: torch.Tensor | None = None
    index: torch.Tensor | None = None

    def pick(self, x: torch.Tensor, ctx: SequenceParallelContext, first: bool = False) -> Any:
        if self.positions is None or self.index is None:
            raise RuntimeError(
                "a sequence-parallel pooled head ran outside its model's forward; call the "
                "boosted model (model(input_ids=..., labels=...))."
            )
        if first:  # x is the shard's first token, (B, ...)
            return pick_tokens(x.unsqueeze(1), self.positions[:1], self.index, ctx.group)
        return pick_tokens(x, self.positions, self.index, ctx.group)


def _head_index(kwargs: dict[str, Any], token: str, config: Any, seq: int,
                device: torch.device) -> torch.Tensor:  # fmt: skip
    """``(B,)`` global positions of the pooled token, as transformers chooses it."""
    ids = kwargs.get("input_ids")
    ref = ids if ids is not None else kwargs["inputs_embeds"]
    batch = ref.shape[0]
    if token == "first":
        return torch.zeros(batch, dtype=torch.long, device=device)
    pad = getattr(config, "pad_token_id", None)
    if pad is None or ids is None:
        return torch.full((batch,), seq - 1, dtype=torch.long, device=device)
    # the rightmost token that is not padding (works for left and right padding)
    nonpad = (ids != pad).to(torch.long)
    return (torch.arange(seq, device=ids.device) * nonpad).argmax(-1).to(device)


def _opt_positions(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """OPT's position ids from the whole padding mask (``None``: no mask, plain positions)."""
    mask = kwargs.get("attention_mask")
    if mask is None or kwargs.get("position_ids") is not None:
        return kwargs.get("position_ids")
    mask = mask.to(torch.long)
    return torch.cumsum(mask, dim=1) * mask - 1


class _TextInputs:
    """The model's forward pre-hook for token inputs: family preparation (OPT positions), the
    pooled token's index, then the shared cut (``split``); per-sample labels of a pooled head
    stay whole."""

    def __init__(
        self,
        ctx: SequenceParallelContext,
        support: ModelSupport,
        split: Callable[..., dict[str, Any]],
        step: _Step,
        config: Any,
    ) -> None:
        self.ctx, self.support, self.split, self.step, self.config = (
            ctx, support, split, step, config
        )  # fmt: skip

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if args:
            raise TypeError(
                "a sequence-parallel model takes its inputs as keywords "
                "(model(input_ids=..., attention_mask=..., labels=...))."
            )
        kwargs = dict(kwargs)
        head = self.support.head
        labels = kwargs.pop("labels", None) if head is not None else None
        if self.support.family == "opt":
            kwargs["position_ids"] = _opt_positions(kwargs)
        ref = kwargs.get("input_ids")
        ref = ref if ref is not None else kwargs.get("inputs_embeds")
        if head is not None and ref is not None:
            seq, ctx = ref.shape[1], self.ctx
            self.step.positions = sequence_positions(seq, ctx.rank, ctx.size, ctx.layout)  # type: ignore[arg-type]
            self.step.index = _head_index(kwargs, head.token, self.config, seq, ref.device)
        out = self.split(self.ctx, kwargs, self.support.causal_lm)
        if labels is not None:
            out["labels"] = labels
        if head is not None and self.support.family != "bert":
            out["use_cache"] = False
        return (), out


def _refuse_image_mask(kwargs: dict[str, Any]) -> None:
    if kwargs.get("attention_mask") is not None:
        raise NotImplementedError(
            "sequence parallelism with a ViT attention_mask: the padding added to reach a "
            "multiple of sp_size is masked internally; call the model without attention_mask."
        )


class _ImageInputs:
    """ViT: the model's pre-hook clears the step; the embeddings' forward hook pads, masks and
    cuts the sequence of CLS + patch embeddings (positions already added)."""

    def __init__(self, ctx: SequenceParallelContext, step: _Step) -> None:
        self.ctx, self.step = ctx, step

    def before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        _refuse_image_mask(kwargs)
        self.ctx.key_padding_mask = None
        self.ctx.targets = None
        self.step.positions = self.step.index = None

    def cut(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        batch, seq = output.shape[0], output.shape[1]
        parts = ctx.size * (2 if ctx.layout == "zigzag" else 1)
        padded = -(-seq // parts) * parts
        ctx.key_padding_mask = None
        if padded != seq:  # pad at the end; the padded keys are masked in every attention
            output = F.pad(output, (0, 0, 0, padded - seq))
            keep = torch.arange(padded, device=output.device) < seq
            ctx.key_padding_mask = ctx.split(keep.unsqueeze(0).expand(batch, -1))
        self.step.positions = sequence_positions(padded, ctx.rank, ctx.size, ctx.layout)  # type: ignore[arg-type]
        self.step.index = torch.zeros(batch, dtype=torch.long, device=output.device)
        return ctx.split(output)


def _install_head(model: nn.Module, head: PooledHead, ctx: SequenceParallelContext,
                  step: _Step) -> None:  # fmt: skip
    module = model.get_submodule(head.path)
    if head.reads == "input":

        def pre(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            if args:
                return (step.pick(args[0], ctx).unsqueeze(1), *args[1:]), kwargs
            hidden = step.pick(kwargs["hidden_states"], ctx).unsqueeze(1)
            return args, {**kwargs, "hidden_states": hidden}

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return
    first = head.reads == "first_output"

    def post(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        token = step.pick(output, ctx, first=first)
        return token if first else token.unsqueeze(1).expand_as(output)

    module.register_forward_hook(post)


def install_family_hooks(
    model: nn.Module,
    plan: ModelPlan,
    ctx: SequenceParallelContext,
    support: ModelSupport,
    split: Callable[..., dict[str, Any]],
) -> None:
    """The forward hooks of ``model`` (not under pipeline stages): the input cut (``split``,
    the shared cut of the token inputs, for text; after the embeddings for images) and the
    pooled head's token pick. No communication."""
    step = _Step()
    if support.image:
        image = _ImageInputs(ctx, step)
        model.register_forward_pre_hook(image.before, with_kwargs=True)
        model.get_submodule(plan.layout.embeddings[0]).register_forward_hook(image.cut)
    else:
        hook = _TextInputs(ctx, support, split, step, getattr(model, "config", None))
        model.register_forward_pre_hook(hook, with_kwargs=True)
    if support.head is not None:
        _install_head(model, support.head, ctx, step)


def _image_length(pixel_values: torch.Tensor, config: Any) -> int:
    """ViT's sequence length for ``pixel_values``: the CLS token and one token per patch."""
    size = config.patch_size
    ph, pw = (size, size) if isinstance(size, int) else tuple(size)
    return int((pixel_values.shape[-2] // ph) * (pixel_values.shape[-1] // pw)) + 1


class StageFamily:
    """The family hooks of the pipeline stages (``pp_size > 1``), per micro-batch.

    A stage only sees what travels with the hidden-state shard: the micro-batch's model inputs
    as the first stage passed them on (the shards of the per-token inputs and masks, OPT's
    ``position_ids`` computed from the whole mask before the cut, ``pixel_values``, a pooled
    head's per-sample ``labels``, whole). From those every stage rebuilds what its hooks need:

    * ViT: the padding-mask shard, from the patch count of ``pixel_values`` (the first stage's
      embeddings hook cuts the sequence itself, as without a pipeline);
    * the last stage, for a pooled head: the global positions of its tokens (the shard length
      times ``sp_size``) and the pooled token's index: the first, or the last non-pad token,
      the largest position of a non-pad token over the SP group (an all-reduce of the maxima
      of the ``input_ids`` shards: transformers' argmax over the whole sequence).

    Args:
        ctx: the SP context.
        support: what the model needs (:func:`model_support`).
        config: the model's transformers config.
        embeddings: the path of ViT's embeddings (where the sequence is cut).
    """

    def __init__(self, ctx: SequenceParallelContext, support: ModelSupport, config: Any,
                 embeddings: str) -> None:  # fmt: skip
        self.ctx, self.support, self.config, self.embeddings = ctx, support, config, embeddings
        self.step = _Step()

    @property
    def pooled(self) -> bool:
        """A pooled task head: per-sample labels, the model's own loss on the whole batch."""
        return self.support.head is not None and self.support.causal_lm is None

    def install(self, model: nn.Module) -> None:
        """Hooks on modules the stage chunks share with ``model``: ViT's cut after the
        embeddings (first stage), the pooled head's token pick (last stage). No communication."""
        if self.support.image:
            image = _ImageInputs(self.ctx, self.step)
            model.get_submodule(self.embeddings).register_forward_hook(image.cut)
        if self.support.head is not None:
            _install_head(model, self.support.head, self.ctx, self.step)

    def first_inputs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The first stage's micro-batch before the cut: OPT's positions from the whole padding
        mask; a pooled head's per-sample labels taken out (they travel whole)."""
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels", None) if self.pooled else None
        if self.support.family == "opt":
            kwargs["position_ids"] = _opt_positions(kwargs)
        return kwargs, labels

    def before_stage(self, kwargs: dict[str, Any], last: bool) -> None:
        """Every stage, before its forward on one micro-batch (``kwargs``: what it received).

        Raises:
            NotImplementedError: a ViT ``attention_mask``.
        """
        ctx, step = self.ctx, self.step
        step.positions = step.index = None
        if self.support.image:
            _refuse_image_mask(kwargs)
            pixels = kwargs["pixel_values"]
            seq = _image_length(pixels, self.config)
            parts = ctx.size * (2 if ctx.layout == "zigzag" else 1)
            padded = -(-seq // parts) * parts
            keep = torch.arange(padded, device=pixels.device) < seq
            batch = pixels.shape[0]
            ctx.key_padding_mask = (
                None if padded == seq else ctx.split(keep.unsqueeze(0).expand(batch, -1))
            )
            step.positions = sequence_positions(padded, ctx.rank, ctx.size, ctx.layout)  # type: ignore[arg-type]
            step.index = torch.zeros(batch, dtype=torch.long, device=pixels.device)
            return
        head = self.support.head
        if head is None or not last:
            return
        ids = kwargs.get("input_ids")
        ref = ids if ids is not None else kwargs["inputs_embeds"]
        seq = ref.shape[1] * ctx.size
        positions = sequence_positions(seq, ctx.rank, ctx.size, ctx.layout)  # type: ignore[arg-type]
        step.positions = positions
        pad = getattr(self.config, "pad_token_id", None)
        if head.token == "first" or pad is None or ids is None:
            step.index = _head_index(kwargs, head.token, self.config, seq, ref.device)
            return
        nonpad = (ids != pad).to(torch.long)
        local = (positions.to(ids.device)[None, :] * nonpad).amax(1)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ctx.group)  # SYNC POINT (SP group)
        step.index = local
