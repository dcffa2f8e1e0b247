"""The models the benchmarks train: GPT-2-style decoders from ``transformers`` configs, and
kolossos' own ResNet and ViT. Each comes with its synthetic batches and its loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "CausalLM", "ModelSpec", "get_model"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: how to build it, feed it and score it."""

    name: str
    """registry key, e.g. ``gpt2-50m``"""
    family: str
    """``gpt2``, ``resnet`` or ``vit``"""
    description: str
    """one line for the report"""
    build: Callable[[], nn.Module]
    """a fresh model (weights from torch's global RNG: seed before calling)"""
    make_batch: Callable[[torch.Generator, int], Batch]
    """``(generator, batch size) -> (inputs, targets)``"""
    seq_len: int = 1
    """tokens per sample (1 for images): throughput is reported in tokens/s when > 1"""
    quick: bool = False
    """small enough for the ``--quick`` smoke run"""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over tokens (decoders) or samples (classifiers)."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    @property
    def unit(self) -> str:
        """``tokens`` or ``samples``."""
        return "tokens" if self.seq_len > 1 else "samples"


class CausalLM(nn.Module):
    """A Hugging Face causal LM whose ``forward(input_ids)`` returns the logits tensor."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=input_ids, use_cache=False).logits
        return logits

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks (the units FSDP2 shards)."""
        blocks: nn.ModuleList = self.model.transformer.h  # type: ignore[union-attr,assignment]
        return list(blocks)


def _gpt2(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as exc:  # optional dependency
            raise ImportError(
                "the GPT-2 benchmark models need transformers: pip install -e '.[hf]'"
            ) from exc
        config = GPT2Config(
            vocab_size=vocab,
            n_positions=seq,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return CausalLM(GPT2LMHeadModel(config))

    return build


def _tokens(vocab: int, seq: int) -> Callable[[torch.Generator, int], Batch]:
    def make(gen: torch.Generator, batch: int) -> Batch:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return make


def _images(size: int, classes: int) -> Callable[[torch.Generator, int], Batch]:
    def make(gen: torch.Generator, batch: int) -> Batch:
        images = torch.randn(batch, 3, size, size, generator=gen)
        return images, torch.randint(0, classes, (batch,), generator=gen)

    return make


def _resnet(width: int, layers: tuple[int, int, int, int]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from kolossos.models import BasicBlock, ResNet

        return ResNet(BasicBlock, layers, 10, cifar_stem=True, base_width=width)

    return build


def _vit(dim: int, depth: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from kolossos.models import VisionTransformer

        return VisionTransformer(32, 4, 10, dim, depth, heads)

    return build


def _gpt2_spec(
    name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, quick: bool = False
) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="gpt2",
        description=f"GPT-2 decoder: {layers} layers, hidden {hidden}, vocab {vocab}, seq {seq}",
        build=_gpt2(layers, hidden, heads, vocab, seq),
        make_batch=_tokens(vocab, seq),
        seq_len=seq,
        quick=quick,
    )


#: every benchmark model by name (parameter counts in the descriptions are for these configs)
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _gpt2_spec("gpt2-tiny", 2, 128, 4, 2048, 64, quick=True),  # 0.7M parameters
        _gpt2_spec("gpt2-30m", 6, 384, 6, 50257, 128),  # 30M
        _gpt2_spec("gpt2-50m", 8, 512, 8, 50257, 128),  # 51M
        _gpt2_spec("gpt2-120m", 12, 768, 12, 50257, 128),  # 124M (GPT-2 small)
        _gpt2_spec("gpt2-1b", 18, 2048, 16, 50257, 1024),  # 1.0B, for one GPU (MFU)
        ModelSpec(
            name="resnet-tiny",
            family="resnet",
            description="ResNet (BasicBlock 1-1-1-1, width 8), CIFAR stem, 32x32 images",
            build=_resnet(8, (1, 1, 1, 1)),
            make_batch=_images(32, 10),
            quick=True,
        ),
        ModelSpec(
            name="resnet18",
            family="resnet",
            description="ResNet-18, CIFAR stem, 32x32 images, 10 classes",
            build=_resnet(64, (2, 2, 2, 2)),
            make_batch=_images(32, 10),
        ),
        ModelSpec(
            name="vit-tiny",
            family="vit",
            description="ViT: dim 64, depth 2, 4 heads, 32x32 images in 4x4 patches",
            build=_vit(64, 2, 4),
            make_batch=_images(32, 10),
            quick=True,
        ),
        ModelSpec(
            name="vit-small",
            family="vit",
            description="ViT-S: dim 384, depth 12, 6 heads, 32x32 images in 4x4 patches",
            build=_vit(384, 12, 6),
            make_batch=_images(32, 10),
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    """The spec called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}.")
    return MODELS[name]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules FSDP2 wraps one by one (blocks / stages), before the root."""
    if isinstance(model, CausalLM):
        return model.blocks()
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.Sequential):  # kolossos ViT
        return list(blocks)
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]  # kolossos ResNet
    return [s for s in stages if isinstance(s, nn.Module)]
