"""Deterministic, learnable synthetic data for tests and benchmarks: images and token sequences.

Both datasets generate each sample on demand from ``(seed, index)`` alone, so they cost no memory,
give the same sample in every process and DataLoader worker, and never depend on the global RNG.
They carry structure a model can learn (class-dependent image patterns; token sequences that mostly
follow a fixed successor table), so training curves on them actually go down.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["SyntheticImageDataset", "SyntheticTokenDataset"]

_PATTERN_GRID = 4  # side of the random grid a class pattern is upsampled from (low frequency)


def _generator(seed: int, stream: int) -> torch.Generator:
    """A generator for sample ``stream`` of dataset ``seed``.

    torch's CPU generator keeps only the low 32 bits of a seed, so the pair is folded into 32 bits
    by ``seed * odd + stream``: a bijection in ``stream``, hence no two samples of a dataset share
    their random numbers, and other seeds shift the streams far beyond any dataset size.
    """
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + stream) & 0xFFFFFFFF)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1.")


def _check_index(index: int, size: int) -> int:
    """``index`` as a non-negative int (negative indices count from the end, as for lists)."""
    index = operator.index(index)
    if not -size <= index < size:
        raise IndexError(f"index {index} out of range for a dataset of {size} samples")
    return index % size


class SyntheticImageDataset(Dataset[tuple[Any, Any]]):
    """Images whose class decides a smooth colour pattern, plus per-sample noise and jitter.

    Sample ``i`` is ``pattern[label] + noise``, shifted by up to 2 pixels and clipped to [0, 1];
    the class patterns depend only on ``seed``, so two datasets with the same ``seed`` and
    different ``index_offset`` are a train and a test split of one distribution. Labels are
    balanced (``size // num_classes`` or one more per class) and shuffled.

    Args:
        size: number of samples.
        image_shape: ``(channels, height, width)``.
        num_classes: number of classes.
        seed: decides the class patterns, the labels and the noise.
        index_offset: first sample stream; give the test split an offset >= the train size so its
            samples differ from the training ones.
        noise_std: standard deviation of the Gaussian noise (images live in [0, 1]).
        dtype: ``torch.uint8`` (0..255, like decoded image files) or a float dtype ([0, 1]).
        transform: applied to the ``(C, H, W)`` image tensor.
        target_transform: applied to the int label.

    Example:
        >>> ds = SyntheticImageDataset(size=100, image_shape=(3, 32, 32), num_classes=10)
        >>> image, label = ds[0]
        >>> image.shape, image.dtype, 0 <= label < 10
        (torch.Size([3, 32, 32]), torch.uint8, True)
    """

    def __init__(
        self,
        size: int = 50_000,
        image_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        seed: int = 0,
        *,
        index_offset: int = 0,
        noise_std: float = 0.25,
        dtype: torch.dtype = torch.uint8,
        transform: Callable[[torch.Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
    ) -> None:
        if len(image_shape) != 3:
            raise ValueError(f"image_shape={image_shape} must be (channels, height, width).")
        _check_positive(size=size, num_classes=num_classes, channels=image_shape[0],
                        height=image_shape[1], width=image_shape[2])  # fmt: skip
        if dtype != torch.uint8 and not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype} must be torch.uint8 or a floating-point dtype.")
        if noise_std < 0:
            raise ValueError(f"noise_std={noise_std} must be >= 0.")
        self.size, self.image_shape, self.num_classes = size, tuple(image_shape), num_classes
        self.seed, self.index_offset = seed, index_offset
        self.noise_std, self.dtype = noise_std, dtype
        self.transform, self.target_transform = transform, target_transform
        g = _generator(seed, 0xFFFFFFFF)
        channels = image_shape[0]
        self._grids = torch.rand(num_classes, channels, _PATTERN_GRID, _PATTERN_GRID, generator=g)
        order = torch.randperm(size, generator=_generator(seed ^ 0x5EED, index_offset))
        self.labels = (order % num_classes).tolist()

    def __len__(self) -> int:
        return self.size

    def pattern(self, label: int) -> torch.Tensor:
        """The noise-free float image of class ``label``, values in [0, 1]."""
        _, height, width = self.image_shape
        grid = self._grids[label].unsqueeze(0)
        return F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False)[0]

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        index = _check_index(index, self.size)
        label = self.labels[index]
        g = _generator(self.seed, self.index_offset + index)
        noise = torch.randn(self.image_shape, generator=g) * self.noise_std
        dy, dx = torch.randint(-2, 3, (2,), generator=g).tolist()
        image = (self.pattern(label) + noise).roll((dy, dx), dims=(1, 2)).clamp_(0.0, 1.0)
        if self.dtype == torch.uint8:
            out = image.mul_(255).add_(0.5).to(torch.uint8)  # round half up; faster than round_
        else:
            out = image.to(self.dtype)
        return (
            self.transform(out) if self.transform else out,
            self.target_transform(label) if self.target_transform else label,
        )


class SyntheticTokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Token sequences that follow a fixed random successor table with probability ``follow_prob``.

    Each token is, with probability ``follow_prob``, the successor of the previous token under a
    permutation of the vocabulary fixed by ``seed``, and otherwise uniformly random. A language
    model can learn the table: the best achievable loss is about
    ``H(follow_prob) + (1 - follow_prob) * ln(vocab_size)`` nats per token instead of
    ``ln(vocab_size)``.

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``.
        seq_len: tokens per sample.
        size: number of samples.
        seed: decides the successor table and every sample.
        follow_prob: probability that a token follows the table (0 gives uniform noise).

    Returns (per sample):
        A dict with ``input_ids`` (int64, ``(seq_len,)``), ``attention_mask`` (all ones) and
        ``labels`` (a copy of ``input_ids``; causal LMs shift them internally).

    Example:
        >>> ds = SyntheticTokenDataset(vocab_size=100, seq_len=16, size=8, seed=0)
        >>> ds[0]["input_ids"].shape, len(ds)
        (torch.Size([16]), 8)
    """

    def __init__(
        self, vocab_size: int, seq_len: int, size: int, seed: int = 0, follow_prob: float = 0.75
    ) -> None:
        _check_positive(vocab_size=vocab_size, seq_len=seq_len, size=size)
        if not 0.0 <= follow_prob <= 1.0:
            raise ValueError(f"follow_prob={follow_prob} must lie in [0, 1].")
        self.vocab_size, self.seq_len, self.size = vocab_size, seq_len, size
        self.seed, self.follow_prob = seed, follow_prob
        self.successor = torch.randperm(vocab_size, generator=_generator(seed, 0xFFFFFFFF))
        self._successor_list: list[int] = self.successor.tolist()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = _generator(self.seed, _check_index(index, self.size))
        fresh = torch.randint(self.vocab_size, (self.seq_len,), generator=g).tolist()
        follow = (torch.rand(self.seq_len, generator=g) < self.follow_prob).tolist()
        succ = self._successor_list
        tokens = [fresh[0]]
        for t in range(1, self.seq_len):  # sequential by nature: a Markov chain
            tokens.append(succ[tokens[-1]] if follow[t] else fresh[t])
        ids = torch.tensor(tokens, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
