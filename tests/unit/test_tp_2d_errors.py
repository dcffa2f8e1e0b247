"""2D tensor parallelism: bad input fails early and clearly, without any process group.

A grid stand-in (``_grid``) fills :class:`Groups2D`'s fields directly, so the block layout
(:func:`slice_2d_shard`) and the validation that runs before the first collective can be checked
in one process.
"""

from __future__ import annotations

import pytest
import torch

from kolossos.nn.layer.parallel_2d import (
    CrossEntropyLoss2D,
    Dropout2D,
    Embedding2D,
    Groups2D,
    LayerNorm2D,
    Linear2D,
    Shard2DSpec,
    VocabParallelEmbedding2D,
    check_divisible,
    slice_2d_shard,
    summa_dim,
)


def _grid(i: int, j: int, q: int = 2) -> Groups2D:
    """Rank ``(i, j)`` of a ``q x q`` grid, without process groups."""
    groups = object.__new__(Groups2D)
    fields = {
        "row": None,
        "col": None,
        "q": q,
        "row_index": i,
        "col_index": j,
        "row_ranks": (),
        "col_ranks": (),
    }
    for name, value in fields.items():
        object.__setattr__(groups, name, value)
    return groups


@pytest.mark.parametrize("size", [2, 3, 8, 0, -4])
def test_size_must_be_a_square(size: int) -> None:
    with pytest.raises(ValueError, match=rf"square number of ranks.*got {size}"):
        summa_dim(size)


def test_summa_dim_of_squares() -> None:
    assert [summa_dim(n) for n in (1, 4, 9, 16)] == [1, 2, 3, 4]
    with pytest.raises(TypeError):
        summa_dim(True)


def test_features_not_divisible_by_q() -> None:
    with pytest.raises(
        ValueError, match=r"Linear2D: in_features=7 is not divisible by 2.*multiple"
    ):
        Linear2D(7, 8, groups=_grid(0, 0))
    with pytest.raises(ValueError, match=r"out_features \(with a bias\)=6 is not divisible by 4"):
        Linear2D(8, 6, groups=_grid(0, 0))  # a bias needs out_features divisible by q²
    with pytest.raises(ValueError, match="normalized_shape=6 is not divisible by 4"):
        LayerNorm2D(6, groups=_grid(0, 0))
    with pytest.raises(ValueError, match="num_embeddings=5 is not divisible by 2"):
        VocabParallelEmbedding2D(5, 8, groups=_grid(0, 0))
    assert check_divisible("X", "dim", 12, 3) == 4


def test_groups_are_checked() -> None:
    with pytest.raises(TypeError, match="must be a Groups2D"):
        Linear2D(8, 8, groups=None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"kolossos\.launch"):
        Groups2D(row=None, col=None)  # type: ignore[arg-type]


def test_unsupported_options_are_named() -> None:
    with pytest.raises(NotImplementedError, match=r"max_norm=1\.0"):
        Embedding2D(10, 8, None, None, None, 1.0, groups=_grid(0, 0))
    with pytest.raises(NotImplementedError, match="sparse=True"):
        VocabParallelEmbedding2D(10, 8, groups=_grid(0, 0), sparse=True)
    with pytest.raises(TypeError, match="size_average"):
        CrossEntropyLoss2D(groups=_grid(0, 0), size_average=True)
    with pytest.raises(TypeError, match="rng_context"):
        Dropout2D(0.1, groups=_grid(0, 0), rng_context=3)  # type: ignore[arg-type]


def test_block_layouts() -> None:
    """``Linear2D``'s weight: block ``(i, j)`` of ``Wᵀ``; a bias: piece ``i`` of block ``j``."""
    weight = torch.arange(8 * 4).reshape(8, 4)  # dense [out=8, in=4]
    bias = torch.arange(8)
    for i in range(2):
        for j in range(2):
            g = _grid(i, j)
            spec = Shard2DSpec(
                full_shape=(8, 4), splits=((0, "col"), (1, "row")), transposed=True, groups=g
            )
            block = slice_2d_shard(weight, spec)
            assert spec.shard_shape() == (2, 4) == tuple(block.shape)
            assert torch.equal(block, weight.t()[2 * i : 2 * i + 2, 4 * j : 4 * j + 4])
            bias_spec = Shard2DSpec(full_shape=(8,), splits=((0, "row"), (0, "col")), groups=g)
            assert slice_2d_shard(bias, bias_spec).tolist() == [4 * j + 2 * i, 4 * j + 2 * i + 1]


def test_bad_specs() -> None:
    g = _grid(0, 0)
    with pytest.raises(ValueError, match="transposed=True needs a 2-D tensor"):
        Shard2DSpec(full_shape=(4, 4, 4), splits=(), transposed=True, groups=g)
    with pytest.raises(ValueError, match="cannot be split into q=2"):
        Shard2DSpec(full_shape=(6,), splits=((0, "row"), (0, "col")), groups=g)
    with pytest.raises(ValueError, match="axis 'depth'"):
        Shard2DSpec(full_shape=(4,), splits=((0, "depth"),), groups=g)
    with pytest.raises(ValueError, match="not the full shape"):
        slice_2d_shard(torch.zeros(3), Shard2DSpec(full_shape=(4,), splits=(), groups=g))
