"""Activation memory of one micro-batch of a Hugging Face transformer, as our stack runs it.

The counts are what ``transformers`` 5's modeling code keeps for backward, tensor by tensor
(found with :class:`~kolossos.accelerator.TensorMemoryTracker` and checked by
``benchmarks/plan_accuracy.py``), per token of the micro-batch:

* attention goes through ``scaled_dot_product_attention``'s flash kernel (no ``s x s`` scores,
  a ``logsumexp`` of ``heads`` fp32 values per token), with no padding mask and no KV cache
  (``use_cache=False``); grouped-query attention keeps ``kv_heads`` keys and values;
* GPT-2's ``gelu_new`` keeps three intermediates besides its input and output; LLaMA's RMSNorm
  keeps an fp32 copy of its input whatever the working dtype;
* dropout keeps a one-byte mask per element and site (CUDA's ``native_dropout``); attention
  dropout adds nothing with the flash kernel;
* the causal-LM loss (transformers' ``ForCausalLMLoss``) keeps the logits (the model output
  holds them), their fp32 ``log_softmax`` and the shifted labels, and its backward briefly holds
  two fp32 logits-sized gradients; BERT's masked-LM loss runs in the working dtype.

Each term is marked by how tensor parallelism divides it: ``split`` (heads, MLP width, vocabulary:
divided by ``tp``), ``rep`` (replicated under TP; split along the sequence under sequence
parallelism) or ``gat`` (norm outputs feeding column-parallel layers: full size under both).

Example:
    >>> from kolossos.utils.profiling.model_shape import load_model_shape
    >>> act = activation_bytes(load_model_shape("gpt2-tiny"), tokens=64, working_bytes=4)
    >>> act.layer  # (8h + 5I + a + 4) fp32 elements per token: 28*128 + 8 = 3592
    919552.0
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.utils.profiling.model_params import padded_vocab
from kolossos.utils.profiling.model_shape import ModelShape

__all__ = ["ActivationBytes", "Term", "activation_bytes"]

#: bytes of an element of each term dtype (``w``: the working dtype)
_FIXED_BYTES = {"f32": 4, "i64": 8, "b1": 1}
#: fraction of the MLP width (working dtype) a block's backward adds on top of what it keeps:
#: the gradients of the activation's intermediates, measured at 1.4-1.7 for the four families
LAYER_BACKWARD_WIDTH = 1.5


@dataclass(frozen=True)
class Term:
    """Elements per token of one kept tensor."""

    elements: float
    dtype: str
    """``w`` (working dtype), ``f32``, ``i64`` or ``b1``"""
    tp: str = "rep"
    """``rep``, ``gat`` or ``split`` (module doc)"""


def _act_kept(activation: str) -> int:
    """MLP-width tensors an activation function keeps besides its output (kept by the next
    linear): ``gelu_new`` keeps its input and three intermediates, ReLU its output only."""
    if activation in ("gelu_new", "gelu_fast"):
        return 4
    if activation == "relu":
        return 0
    return 1


def _dropout(m: ModelShape, sites: int) -> list[Term]:
    return [Term(sites * m.hidden, "b1")] if m.hidden_dropout > 0 and sites else []


def _attention(m: ModelShape) -> list[Term]:
    """q, k, v (GPT-2: its fused qkv output), the attention output and the flash kernel's
    logsumexp."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return [
        Term(q + 2 * kv, "w", "split"),
        Term(q, "w", "split"),
        Term(m.heads, "f32", "split"),
    ]


def _layer_terms(m: ModelShape) -> list[Term]:
    h, inner, kept = m.hidden, m.intermediate, _act_kept(m.activation)
    if m.family == "llama":  # RMSNorm: fp32 input copy, rsqrt, normalised, output
        norm = [Term(h, "f32"), Term(1, "f32"), Term(h, "w"), Term(h, "w", "gat")]
        mlp = Term((kept + 3) * inner, "w", "split")  # gate, act out, up, product
        return [*norm, *_attention(m), *norm, mlp]
    ln = [Term(2, "w"), Term(h, "w", "gat")]  # LayerNorm: mean/rstd, output
    mlp = Term((kept + 1) * inner, "w", "split")
    if m.family == "bert":  # post-LN: the block's input is the previous LayerNorm's output
        return [
            *_attention(m),
            *[Term(h, "w"), *ln],
            mlp,
            *[Term(h, "w"), *ln],
            *_dropout(m, 2),
        ]
    return [
        Term(h, "w"),
        *ln,
        *_attention(m),
        Term(h, "w"),
        *ln,
        mlp,
        *_dropout(m, 2),
    ]


def _embed_terms(m: ModelShape) -> list[Term]:
    h = m.hidden
    if m.family == "bert":  # embeddings' sum and LayerNorm: the first block's input
        return [Term(h, "w"), Term(2, "w"), Term(h, "w", "gat"), *_dropout(m, 1)]
    if m.family == "opt":
        e = m.embed_dim or h
        return [Term(1, "i64"), *([Term(e, "w")] if e != h else []), *_dropout(m, 1)]
    return _dropout(m, 1) if m.family in ("gpt2", "vit") else []


def _head_terms(m: ModelShape) -> list[Term]:
    """The final norm (and BERT's transform, OPT's projection), before the logits."""
    h = m.hidden
    if m.family == "llama":
        return [Term(h, "f32"), Term(1, "f32"), Term(h, "w"), Term(h, "w", "gat")]
    if m.family == "bert":
        return [Term(h, "w"), Term(h, "w"), Term(2, "w"), Term(h, "w", "gat")]
    terms = [Term(h, "w")]
    if m.family != "opt" or m.final_norm:
        terms += [Term(2, "w"), Term(h, "w", "gat")]
    if m.family == "opt" and (m.embed_dim or h) != h:
        terms.append(Term(m.embed_dim, "w", "gat"))
    return terms


@dataclass(frozen=True, kw_only=True)
class ActivationBytes:
    """Activation bytes of one micro-batch on one rank."""

    embed: float
    """kept by the embeddings"""
    layer: float
    """kept by one block"""
    layer_checkpointed: float
    """kept by one block under activation checkpointing (its input)"""
    head: float
    """kept by the final norm, the output head and the loss (logits included)"""
    logits: float
    """the logits alone (the model's output holds them through backward)"""
    loss_kept: float
    """kept by the loss itself (``log_softmax`` or softmax, labels): gone after its backward"""
    logits_grad: float
    """the logits' gradient, alive while the output head runs its backward"""
    hidden_grad: float
    """the gradient of a block's output (the head's input), in the working dtype"""
    forward_transient: float
    """alive only while the loss is computed (fp32 copies of low-precision logits)"""
    loss_transient: float
    """alive at the start of backward: the loss's gradients"""
    layer_transient: float
    """alive inside a block's backward besides what the block keeps"""

    def kept(self, layers: int, checkpointed: bool, embed: bool = True, head: bool = True) -> float:
        """Bytes kept for backward by ``layers`` blocks (plus the embeddings and the head)."""
        per_layer = self.layer_checkpointed if checkpointed else self.layer
        return layers * per_layer + embed * self.embed + head * self.head


def _bytes(terms: list[Term], w: int, tp: int, sp: bool) -> float:
    total = 0.0
    for t in terms:
        size = w if t.dtype == "w" else _FIXED_BYTES[t.dtype]
        divide = t.tp == "split" or (sp and t.tp == "rep")
        total += t.elements * size / (tp if divide else 1)
    return total


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    working_bytes: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    vocab_divisible_by: int = 64,
    output_fp32: bool = False,
) -> ActivationBytes:
    """The :class:`ActivationBytes` of a micro-batch of ``tokens`` tokens (batch x sequence).

    Args:
        shape: the model.
        tokens: tokens in the micro-batch.
        working_bytes: bytes per element of the working dtype (2: fp16/bf16, 4: fp32).
        tp_size: tensor-parallel size (the output head is vocabulary-parallel when > 1).
        sequence_parallel: Megatron sequence parallelism over the tensor-parallel group.
        vocab_divisible_by: ``make_vocab_size_divisible_by`` of the sharded vocabulary.
        output_fp32: the model's output holds fp32 logits whatever the working dtype (FSDP's
            ``output_dtype``).
    """
    w, t = working_bytes, tp_size
    n = float(tokens)
    per = lambda terms: n * _bytes(terms, w, t, sequence_parallel)  # noqa: E731
    h = shape.hidden
    vocab = padded_vocab(shape.vocab, t, vocab_divisible_by) if t > 1 else shape.vocab
    local_v = vocab / t
    held = 4 if output_fp32 else w  # bytes per logit the model's output holds
    if shape.causal_lm:
        logits = n * held * local_v
        if t > 1:  # vocabulary-parallel loss: its fp32 softmax becomes the logits' gradient
            loss_kept = n * 4 * local_v
            forward_t = n * 4 * local_v if w != 4 else 0.0  # the fp32 copy of the logits
            loss_t, logits_grad = n * w * local_v * (w != 4), n * w * local_v
        else:  # log_softmax kept; nll's and log_softmax's gradients start the backward
            loss_kept = n * 4 * vocab
            forward_t = n * 4 * vocab if w != 4 else 0.0
            loss_t, logits_grad = n * 8 * vocab, n * w * vocab
        loss_kept += n * 8  # the shifted labels (int64)
    elif shape.family == "bert":  # loss in the working dtype over (gathered) logits
        logits = n * held * (local_v + (vocab if t > 1 else 0))
        loss_kept, forward_t = n * w * vocab, 0.0
        loss_t, logits_grad = n * 2 * w * vocab, n * w * vocab
    else:  # ViT: the classifier sees the class token only
        logits = loss_kept = forward_t = loss_t = logits_grad = 0.0
    checkpointed = n * w * h / (t if sequence_parallel else 1)
    return ActivationBytes(
        embed=per(_embed_terms(shape)),
        layer=per(_layer_terms(shape)),
        layer_checkpointed=checkpointed,
        head=per(_head_terms(shape)) + logits + loss_kept,
        logits=logits,
        loss_kept=loss_kept,
        logits_grad=logits_grad,
        hidden_grad=n * w * h,
        forward_transient=forward_t,
        loss_transient=loss_t,
        layer_transient=n * w * LAYER_BACKWARD_WIDTH * shape.intermediate / t,
    )
