"""Data helpers of the legacy tutorials: ``build_cifar`` (CIFAR-10 loaders with the documented
transforms) and the GPT tutorial's ``WebtextDataset`` (loose JSON -> GPT-2 tokens, cached).

Example:
    >>> from kolossos.legacy.data import WebtextDataset, build_cifar  # doctest: +SKIP
"""

from kolossos.legacy.data.cifar import CifarTransform, build_cifar
from kolossos.legacy.data.webtext import WebtextDataset, gpt2_tokenizer, write_sample_webtext

__all__ = [
    "CifarTransform",
    "WebtextDataset",
    "build_cifar",
    "gpt2_tokenizer",
    "write_sample_webtext",
]
