"""``autoparallelize``'s mesh checks (no process group): shapes, sizes, the batch over the
data-parallel axis and the heads over the tensor-parallel axis, and which ``dp x tp``
families a mesh offers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kolossos.auto_parallel.auto_mesh import check_mesh, check_transformer_sizes, hybrid_sizes
from kolossos.device.device_mesh import DeviceMesh


def _mesh(*shape: int) -> DeviceMesh:
    return DeviceMesh(torch.arange(int(torch.tensor(shape).prod())), shape, device="cpu")


def test_shapes() -> None:
    assert check_mesh(None, 4) is None
    assert check_mesh(_mesh(4), 4) is None
    assert check_mesh(_mesh(2, 2), 4) == (2, 2)
    assert check_mesh(_mesh(2, 3), 6) == (2, 3)


def test_mesh_errors_name_value_rule_and_fix() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 2\) holds 4 ranks but the job has 8.*"
                       r"Pass a mesh of 8 ranks or None"):  # fmt: skip
        check_mesh(_mesh(2, 2), 8)
    with pytest.raises(ValueError, match=r"shape \(2,\) holds 2 ranks but the job has 4"):
        check_mesh(_mesh(2), 4)
    with pytest.raises(NotImplementedError, match=r"1-d and 2-d.*got shape \(2, 2, 2\)"):
        check_mesh(_mesh(2, 2, 2), 8)
    with pytest.raises(TypeError, match=r"device_mesh=\(2, 2\) must be a torch DeviceMesh"):
        check_mesh((2, 2), 4)


def test_batch_and_heads_over_the_axes() -> None:
    gpt2 = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4))
    check_transformer_sizes(gpt2, (2, 2), batch=8)
    check_transformer_sizes(gpt2, (4, 4), batch=8)
    with pytest.raises(ValueError, match=r"batch of 6 .* 4 data-parallel ranks .* multiple of 4"):
        check_transformer_sizes(gpt2, (4, 2), batch=6)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 .* 3 tensor-parallel ranks"):
        check_transformer_sizes(gpt2, (2, 3), batch=8)
    llama = SimpleNamespace(config=SimpleNamespace(num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 .* multiple of 4"):
        check_transformer_sizes(llama, (2, 4), batch=8)


def test_hybrid_families_offered() -> None:
    assert hybrid_sizes((2, 2), 4, batch=8) == [2]  # the mesh's own layout only
    assert hybrid_sizes((2, 4), 8, batch=8) == [2]
    assert hybrid_sizes((1, 4), 4, batch=8) == []  # megatron over all ranks is that plan
    assert hybrid_sizes((4, 1), 4, batch=8) == []  # dp over all ranks is that plan
    assert hybrid_sizes(None, 8, batch=8) == [2, 4]  # 1-d: every layout the batch allows
    assert hybrid_sizes(None, 8, batch=6) == [2]
