"""2.5D tensor parallelism without process groups: bad sizes fail clearly before any collective,
and the shard layout (which block of the dense matrix each rank keeps) is the documented one.

The layers read only the integers of :class:`Groups2p5D` while they are built (they slice the
dense initialisation locally), so a ``Groups2p5D`` with placeholder groups is enough here.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_2p5d import (
    Classifier2p5D,
    CrossEntropyLoss2p5D,
    Embedding2p5D,
    Groups2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    PatchEmbedding2p5D,
    TesseractShardSpec,
    VocabParallelClassifier2p5D,
    VocabParallelEmbedding2p5D,
    divide,
    get_2p5d_spec,
    tesseract_dim,
)

_NO_GROUP = cast(ProcessGroup, object())


def _groups(i: int = 1, j: int = 0, k: int = 1, q: int = 2, d: int = 2) -> Groups2p5D:
    g = _NO_GROUP
    return Groups2p5D(
        row=g,
        col=g,
        dep=g,
        xz=g,
        tensor=g,
        tesseract_dim=q,
        tesseract_dep=d,
        row_index=i,
        col_index=j,
        depth_index=k,
    )


@pytest.mark.parametrize(
    ("size", "depth", "match"),
    [
        (8, 3, "does not divide"),
        (12, 1, "not a perfect square"),
        (8, 4, "not a perfect square"),
        (0, 1, "positive int"),
        (8, 0, "positive int"),
        (8, True, "positive int"),
    ],
)
def test_bad_tesseract_sizes(size: int, depth: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tesseract_dim(size, depth)


def test_good_tesseract_sizes() -> None:
    assert [tesseract_dim(s, d) for s, d in ((8, 2), (4, 1), (18, 2), (1, 1), (4, 4))] == [
        2,
        2,
        3,
        1,
        1,
    ]


def test_groups_check_indices() -> None:
    with pytest.raises(ValueError, match="row_index=2 must lie in"):
        _groups(i=2)
    with pytest.raises(ValueError, match="depth_index=2 must lie in"):
        _groups(k=2)
    g = _groups(i=1, j=0, k=1)
    assert (g.batch_parts, g.batch_index) == (4, 3)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda g: Linear2p5D(255, 1024, groups=g), "in_features=255"),
        (lambda g: Linear2p5D(256, 1023, groups=g), "out_features=1023"),
        (lambda g: LayerNorm2p5D(7, groups=g), "normalized_shape=7"),
        (
            lambda g: Embedding2p5D(10, 6, groups=g),
            "embedding_dim=6 must be a positive multiple of 4",
        ),
        (lambda g: VocabParallelEmbedding2p5D(11, 8, groups=g), "num_embeddings=11"),
        (lambda g: Classifier2p5D(6, 10, groups=g), "in_features=6"),
        (lambda g: VocabParallelClassifier2p5D(8, 11, groups=g), "num_classes=11"),
        (lambda g: PatchEmbedding2p5D(8, 4, 3, 6, groups=g), "embed_size=6"),
    ],
)
def test_features_not_divisible(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(_groups())  # type: ignore[operator]


def test_other_bad_arguments() -> None:
    g = _groups()
    with pytest.raises(NotImplementedError, match="flatten=False"):
        PatchEmbedding2p5D(8, 4, 3, 8, flatten=False, groups=g)
    with pytest.raises(TypeError, match="weight_initializer=3"):
        Linear2p5D(8, 8, weight_initializer=3, groups=g)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="normalized_shape"):
        LayerNorm2p5D((8,), groups=g)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction='avg'"):
        CrossEntropyLoss2p5D("avg", groups=g)
    with pytest.raises(ValueError, match="label_smoothing=2"):
        CrossEntropyLoss2p5D(groups=g, label_smoothing=2.0)
    with pytest.raises(ValueError, match="Owner: x=10 must be a positive multiple of 4"):
        divide(10, 4, "x", "Owner")
    emb = Embedding2p5D(10, 8, groups=g)
    with pytest.raises(ValueError, match=r"weight= must be the 2\.5D weight"):
        VocabParallelClassifier2p5D(8, 10, weight=emb.weight, groups=g)
    with pytest.raises(ValueError, match="not divisible by 4"):
        TesseractShardSpec(full_shape=(6, 8), row_dim=0, col_dim=0, groups=g)
    with pytest.raises(ValueError, match="transposed needs a 2-D"):
        TesseractShardSpec(full_shape=(8,), row_dim=0, col_dim=None, transposed=True, groups=g)
    layer = Linear2p5D(8, 8, groups=g)
    with pytest.raises(ValueError, match="expected this rank's feature block of 4"):
        layer(torch.zeros(2, 8))


def test_documented_weight_blocks() -> None:
    """The docs' MLP (256 -> 1024 -> 256) on q = 2, d = 2: weights (128, 512) and (512, 128);
    rank (i, j, k) keeps the transpose of dense block (out block j, in block i), whatever k."""
    for k in (0, 1):
        g = _groups(i=1, j=0, k=k)
        torch.manual_seed(0)
        dense = nn.Linear(256, 1024)
        torch.manual_seed(0)
        fc1 = Linear2p5D(256, 1024, groups=g)
        fc2 = Linear2p5D(1024, 256, groups=g)
        assert tuple(fc1.weight.shape) == (128, 512) and tuple(fc2.weight.shape) == (512, 128)
        torch.testing.assert_close(fc1.weight, dense.weight[:512, 128:].t(), rtol=0, atol=0)
        torch.testing.assert_close(fc1.bias, dense.bias[:512], rtol=0, atol=0)
        spec = get_2p5d_spec(fc1.weight)
        assert spec is not None and spec.replicas == 2
        assert get_2p5d_spec(fc1.bias).replicas == 4  # type: ignore[union-attr]


def test_embedding_piece_order() -> None:
    """Embedding2p5D splits the embedding dimension into q*q pieces, piece j*q + i."""
    g = _groups(i=1, j=0, k=0)
    torch.manual_seed(0)
    dense = nn.Embedding(10, 8)
    torch.manual_seed(0)
    emb = Embedding2p5D(10, 8, groups=g)
    torch.testing.assert_close(emb.weight, dense.weight[:, 2:4], rtol=0, atol=0)
    vocab = VocabParallelEmbedding2p5D(10, 8, groups=g)
    assert (vocab.vocab_start_index, vocab.vocab_end_index) == (5, 10)
