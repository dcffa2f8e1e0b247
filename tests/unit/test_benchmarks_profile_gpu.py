"""``benchmarks.profile_gpu``'s kernel classes and trace accounting (the GPU run itself needs a
device: ``python -m benchmarks.profile_gpu`` on a lent machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ sits beside the package, not installed with it
    sys.path.insert(0, str(ROOT))

from benchmarks.profile_gpu import classify_kernel, kernel_times  # noqa: E402


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
        (
            "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn_align1>",
            "gemm",
        ),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
        ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16>", "norm"),
        ("void at::native::cunn_SoftMaxForward<4, float>", "loss"),
        ("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>", "elementwise"),
    ],
)
def test_classify_kernel(name: str, cls: str) -> None:
    assert classify_kernel(name) == cls


def test_kernel_times_sums_gpu_events_only() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "dur": 1500.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "dur": 500.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 250.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000.0},  # host side: ignored
        {"ph": "i", "cat": "kernel", "name": "marker"},  # not a complete event
    ]
    by_class, by_kernel = kernel_times(events)
    assert by_class == pytest.approx({"gemm": 2e-3, "memcpy": 2.5e-4})
    assert by_kernel == pytest.approx({"nvjet_sm90_gemm": 2e-3, "Memcpy HtoD": 2.5e-4})
