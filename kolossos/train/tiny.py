"""Tiny Hugging Face checkpoints built locally (nothing can be downloaded): a byte-level BPE
tokenizer trained on a small corpus and a randomly initialised LLaMA or GPT-2 saved next to it,
as a model folder ``model.pretrained`` accepts. Used by the examples and the tests.

Example:
    >>> folder = make_tiny_checkpoint("/tmp/tiny-llama", family="llama")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["EOS", "FAMILIES", "make_tiny_checkpoint", "make_tiny_tokenizer"]

#: the end-of-text token of the tiny tokenizer
EOS = "<|endoftext|>"
#: the model families :func:`make_tiny_checkpoint` builds
FAMILIES = ("llama", "gpt2")


def _corpus() -> list[str]:
    from kolossos.train.data import bundled_corpus

    text = bundled_corpus().read_text(encoding="utf-8")[:50_000]
    return text.split("\n\n")


def make_tiny_tokenizer(
    folder: str | Path, vocab_size: int = 320, corpus: list[str] | None = None
) -> Any:
    """Train a byte-level BPE tokenizer (``vocab_size`` ids, :data:`EOS` included) on ``corpus``
    (default: the start of the bundled Shakespeare) and save it in ``folder`` as a
    ``PreTrainedTokenizerFast``; return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kolossos.train.hf_import import transformers_module as _transformers

    transformers = _transformers()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus or _corpus(), trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, bos_token=EOS, pad_token=EOS
    )
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def _config(family: str, vocab: int, eos: int, hidden: int, layers: int, heads: int) -> Any:
    from kolossos.train.hf_import import transformers_module as _transformers

    transformers = _transformers()
    if family == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=128,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=False,
        )
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=128,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            bos_token_id=eos,
            eos_token_id=eos,
        )
    raise ValueError(f"family={family!r} must be one of {FAMILIES}")


def make_tiny_checkpoint(
    folder: str | Path,
    *,
    family: str = "llama",
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    vocab_size: int = 320,
    seed: int = 0,
    weights: str = "safetensors",
    tokenizer: bool = True,
) -> Path:
    """Save a randomly initialised tiny model (and its tokenizer) as a Hugging Face folder.

    Args:
        folder: where to write (created).
        family: ``"llama"`` or ``"gpt2"``.
        hidden, layers, heads: the model's shape.
        vocab_size: the tokenizer's ids (the model gets exactly as many embedding rows).
        seed: seeds the weights.
        weights: ``"safetensors"``, ``"sharded"`` (safetensors shards with an index) or
            ``"bin"`` (one ``pytorch_model.bin``).
        tokenizer: also train and save the tokenizer.

    Returns:
        ``folder`` as a path.
    """
    from kolossos.train.hf_import import transformers_module as _transformers

    transformers = _transformers()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(out, vocab_size) if tokenizer else None
    eos = tok.eos_token_id if tok is not None else 0
    vocab = len(tok) if tok is not None else vocab_size
    config = _config(family, vocab, eos, hidden, layers, heads)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if weights == "bin":
        config.save_pretrained(str(out))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        torch.save(state, out / "pytorch_model.bin")
    elif weights == "sharded":
        model.save_pretrained(str(out), max_shard_size="20KB")
    else:
        model.save_pretrained(str(out))
    return out
