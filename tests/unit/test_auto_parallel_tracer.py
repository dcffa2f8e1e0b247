"""ColoTracer: shapes, dtypes, bytes and FLOPs per node on an MLP, HF GPT-2 and a ResNet-style net,
and clear errors for what it cannot trace."""

from __future__ import annotations

import pytest
import torch

from kolossos.auto_parallel import ColoTracer, TracingError, autoparallelize


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


class _BasicBlock(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class _ResNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = torch.nn.Sequential(_BasicBlock(8), _BasicBlock(8))
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def test_mlp_shapes_bytes_flops() -> None:
    traced = ColoTracer().trace(_mlp(), {"input": torch.empty(4, 32, device="meta")})
    assert traced.backend == "fx"
    first, relu, last = traced["_0"], traced["_1"], traced["_2"]
    assert first.shape == (4, 64) and first.dtypes == (torch.float32,)
    assert first.output_bytes == 4 * 64 * 4
    assert first.flops == 2 * 4 * 64 * 32
    assert relu.flops == 0
    assert last.shape == (4, 8) and last.flops == 2 * 4 * 8 * 64
    assert traced.total_flops == 2 * 4 * 64 * 32 + 2 * 4 * 8 * 64
    assert traced.param_bytes == (32 * 64 + 64 + 64 * 8 + 8) * 4
    assert "total flops" in traced.summary()


def test_functional_matmul_and_bf16_dtype() -> None:
    class Net(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.softmax(a @ b, dim=-1)

    args = {
        "a": torch.empty(2, 5, 7, dtype=torch.bfloat16, device="meta"),
        "b": torch.empty(2, 7, 3, dtype=torch.bfloat16, device="meta"),
    }
    traced = ColoTracer().trace(Net(), args)
    matmul = next(i for i in traced.nodes if i.flops)
    assert matmul.shape == (2, 5, 3) and matmul.dtypes == (torch.bfloat16,)
    assert matmul.flops == 2 * (2 * 5 * 3) * 7
    assert matmul.output_bytes == 2 * 5 * 3 * 2


def test_resnet_conv_flops() -> None:
    model = _ResNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = ColoTracer().trace(model, {"x": torch.empty(2, 3, 8, 8, device="meta")})
    # BatchNorm ran in training mode on fake tensors: the real buffers are untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    stem = traced["stem"]
    assert stem.shape == (2, 8, 8, 8)
    assert stem.flops == 2 * (2 * 8 * 8 * 8) * 3 * 9
    convs = [i for i in traced.nodes if i.target.endswith(("conv1", "conv2"))]
    assert len(convs) == 4
    assert all(i.flops == 2 * (2 * 8 * 8 * 8) * 8 * 9 for i in convs)
    assert traced["fc"].shape == (2, 10)
    assert traced.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_hf_gpt2_traced_with_export() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        vocab_size=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.empty(2, 8, dtype=torch.long, device="meta")
    traced = ColoTracer().trace(model, {"input_ids": ids, "use_cache": False})
    assert traced.backend == "export"
    tokens, hidden = 2 * 8, 16
    addmm = [i for i in traced.nodes if i.target.startswith("aten.addmm")]
    # per block: c_attn (16 -> 48), attn c_proj, mlp c_fc (16 -> 64), mlp c_proj (64 -> 16)
    assert sorted(i.flops for i in addmm) == sorted(
        2 * [2 * tokens * 3 * hidden * hidden, 2 * tokens * hidden * hidden]
        + 2 * [2 * tokens * 4 * hidden * hidden, 2 * tokens * hidden * 4 * hidden]
    )
    attention = [i for i in traced.nodes if "scaled_dot_product_attention" in i.target]
    assert len(attention) == 2
    assert all(i.flops == 4 * (2 * 2 * 8) * 8 * 8 for i in attention)
    logits = traced.nodes[-2]
    assert logits.shape == (2, 8, 64)
    assert traced.param_bytes == sum(p.numel() * 4 for p in model.parameters())


def test_data_dependent_operator_names_the_node() -> None:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nonzero(x)

    with pytest.raises(TracingError, match=r"node 'nonzero'.*operator .*nonzero"):
        ColoTracer().trace(Net(), {"x": torch.empty(4, device="meta")})


def test_control_flow_names_the_last_node() -> None:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.sum()
            if y > 0:
                return x
            return -x

    with pytest.raises(TracingError, match=r"cannot trace Net at node 'gt' \(operator gt\)"):
        ColoTracer().trace(Net(), {"x": torch.empty(4, device="meta")})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="backend"):
        ColoTracer(backend="jit")  # type: ignore[arg-type]
    with pytest.raises(TracingError, match="not inputs"):
        ColoTracer().trace(_mlp(), {"x": torch.empty(4, 32, device="meta")})
    with pytest.raises(RuntimeError, match=r"torch\.distributed"):
        autoparallelize(_mlp(), {"input": torch.empty(4, 32, device="meta")})
