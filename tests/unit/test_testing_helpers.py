"""Colossal-AI's ``colossalai.testing`` helpers in :mod:`kolossos.testing`: each check passes on
equal inputs and raises on unequal ones; the decorators skip, and do not skip, as specified."""

from __future__ import annotations

import inspect
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

import kolossos.accelerator
from kolossos.testing import (
    DummyDataloader,
    assert_close,
    assert_close_loose,
    assert_equal,
    assert_hf_output_close,
    assert_not_equal,
    check_state_dict_equal,
    clear_cache_before_run,
    parameterize,
    run_on_environment_flag,
    skip_if_not_enough_gpus,
    spawn,
)
from kolossos.testing.random import seed_all

# ---------------------------------------------------------------- element-wise comparisons


def test_assert_equal_passes_on_equal_and_raises_on_unequal() -> None:
    assert_equal(torch.arange(4), torch.arange(4))
    assert_equal(torch.ones(2, 3), torch.tensor(1.0))  # broadcasts, as upstream
    with pytest.raises(AssertionError, match="expected equal tensors"):
        assert_equal(torch.arange(4), torch.tensor([0, 1, 2, 4]))
    with pytest.raises(AssertionError, match=r"shapes \(3,\) vs \(4,\)"):
        assert_equal(torch.ones(3), torch.ones(4))


def test_assert_not_equal_passes_on_unequal_and_raises_on_equal() -> None:
    assert_not_equal(torch.arange(4), torch.tensor([0, 1, 2, 4]))  # one element is enough
    assert_not_equal(torch.ones(3), torch.ones(4))  # shapes that do not broadcast differ
    with pytest.raises(AssertionError, match="they are equal"):
        assert_not_equal(torch.ones(2), torch.ones(2))


def test_assert_close_is_torchs() -> None:
    assert assert_close is torch.testing.assert_close
    assert_close(torch.ones(2), torch.ones(2) + 1e-7)
    with pytest.raises(AssertionError):
        assert_close(torch.ones(2), torch.ones(2) + 1e-3)


def test_assert_close_loose_uses_loose_tolerances() -> None:
    a = torch.tensor([1.0, 2.0])
    assert_close_loose(a, a + 5e-4)
    with pytest.raises(AssertionError, match=r"tensors not close \(shape \(2,\) vs \(2,\)"):
        assert_close_loose(a, a + 1e-2)
    assert_close_loose(a, a + 1e-2, rtol=0.0, atol=2e-2)
    with pytest.raises(AssertionError, match="dtype"):
        assert_close_loose(a, a.double())


# ---------------------------------------------------------------- state dicts


def _trained_pair() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    twin = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.1)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(opt.state_dict())
    return model, opt, twin, twin_opt


def test_check_state_dict_equal_passes_on_equal_model_and_optimizer_states() -> None:
    model, opt, twin, twin_opt = _trained_pair()
    check_state_dict_equal(model.state_dict(), twin.state_dict())
    check_state_dict_equal(opt.state_dict(), twin_opt.state_dict(), False)  # upstream's usage


def test_check_state_dict_equal_raises_on_a_different_tensor() -> None:
    model, opt, twin, twin_opt = _trained_pair()
    changed = twin.state_dict()
    changed["2.bias"] = changed["2.bias"] + 0.1
    with pytest.raises(AssertionError, match=r"state_dict\['2.bias'\]"):
        check_state_dict_equal(model.state_dict(), changed)
    state = twin_opt.state_dict()
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"] + 1.0
    with pytest.raises(AssertionError, match=r"\['state'\]\[0\]\['exp_avg'\]"):
        check_state_dict_equal(opt.state_dict(), state)


@pytest.mark.parametrize(
    ("d2", "match"),
    [
        ({"a": torch.ones(2)}, "keys differ"),
        ({"a": torch.ones(2), "b": [1, 2], "c": {"x": 2}}, "keys differ"),
        ({"a": torch.ones(2), "b": [1, 2, 3]}, "lengths differ"),
        ({"a": torch.ones(2), "b": [1, 3]}, r"\['b'\]\[1\]: 2 != 3"),
        ({"a": [1.0, 1.0], "b": [1, 2]}, "a tensor vs list"),
        ({"a": torch.ones(3), "b": [1, 2]}, "shape"),
    ],
)
def test_check_state_dict_equal_raises_on_structure(d2: dict[str, Any], match: str) -> None:
    d1 = {"a": torch.ones(2), "b": [1, 2]}
    check_state_dict_equal(d1, {"a": torch.ones(2), "b": [1, 2]})
    with pytest.raises(AssertionError, match=match):
        check_state_dict_equal(d1, d2)


def test_check_state_dict_equal_dtype_rule_at_every_level() -> None:
    d1: dict[str, Any] = {"w": torch.ones(2), "groups": [{"m": torch.ones(2)}]}
    d2: dict[str, Any] = {"w": torch.ones(2).half(), "groups": [{"m": torch.ones(2).half()}]}
    with pytest.raises(AssertionError, match="dtype"):
        check_state_dict_equal(d1, d2)
    check_state_dict_equal(d1, d2, ignore_dtype=True)
    d2["groups"][0]["m"] = d2["groups"][0]["m"] * 2
    with pytest.raises(AssertionError, match=r"\['groups'\]\[0\]\['m'\]"):
        check_state_dict_equal(d1, d2, ignore_dtype=True)


@pytest.mark.parametrize("ignore_device", [True, False])
def test_check_state_dict_equal_loose_tolerance(ignore_device: bool) -> None:
    d1 = OrderedDict(w=torch.ones(3))
    check_state_dict_equal(d1, OrderedDict(w=torch.ones(3) + 5e-4), ignore_device)
    with pytest.raises(AssertionError):
        check_state_dict_equal(d1, OrderedDict(w=torch.ones(3) + 1e-2), ignore_device)


# ---------------------------------------------------------------- model outputs


def test_assert_hf_output_close_nested() -> None:
    out = {"logits": torch.ones(2, 3), "hidden": (torch.zeros(2), torch.ones(2)), "n": 3}
    same = {"logits": torch.ones(2, 3) + 1e-7, "hidden": (torch.zeros(2), torch.ones(2)), "n": 3}
    assert_hf_output_close(out, same)
    other = {**same, "hidden": (torch.zeros(2), torch.ones(2) * 2)}
    with pytest.raises(AssertionError, match=r"^out\.hidden\.1: "):
        assert_hf_output_close(out, other, track_name="out")
    with pytest.raises(AssertionError, match=r"output\.n: value mismatch, 3 vs 4"):
        assert_hf_output_close(out, {**same, "n": 4})
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_hf_output_close(torch.ones(2), torch.ones(1, 2))
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_hf_output_close([torch.ones(1)], [torch.ones(1)] * 2)
    with pytest.raises(AssertionError, match="keys differ"):
        assert_hf_output_close(out, {"logits": torch.ones(2, 3)})


def test_assert_hf_output_close_ignore_keys_and_tolerances() -> None:
    out1 = {"logits": torch.ones(2), "past_key_values": torch.zeros(1)}
    out2 = {"logits": torch.ones(2) + 1e-3}
    with pytest.raises(AssertionError):
        assert_hf_output_close(out1, out2, ignore_keys=["past_key_values"])
    assert_hf_output_close(out1, out2, ignore_keys=["past_key_values"], atol=1e-2, rtol=0)


def test_assert_hf_output_close_on_transformers_model_outputs() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    a = outputs.CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(1, 2, 4))
    b = outputs.CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(1, 2, 4))
    assert_hf_output_close(a, b)
    c = outputs.CausalLMOutputWithPast(loss=torch.tensor(1.5), logits=torch.ones(1, 2, 4))
    with pytest.raises(AssertionError, match=r"^output\.loss: "):
        assert_hf_output_close(a, c, track_name="output")


# ---------------------------------------------------------------- DummyDataloader


def test_dummy_dataloader_yields_length_batches_per_pass() -> None:
    calls = []

    def gen() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"x": torch.full((2,), float(len(calls)))}

    loader = DummyDataloader(gen, length=3)
    assert len(loader) == 3
    assert [b["x"][0].item() for b in loader] == [1.0, 2.0, 3.0]
    assert sum(1 for _ in loader) == 3  # a new pass each time
    assert next(iter(loader))["x"][0].item() == 7.0
    assert len(DummyDataloader(gen)) == 10
    assert list(DummyDataloader(gen, length=0)) == []
    with pytest.raises(ValueError, match="length=-1"):
        DummyDataloader(gen, length=-1)


# ---------------------------------------------------------------- decorators


class _FakeAccelerator:
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[str] = []

    def synchronize(self) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self) -> None:
        self.calls.append("reset_peak_memory_stats")


@pytest.mark.parametrize(("name", "initialized"), [("cpu", False), ("cuda", True), ("cuda", False)])
def test_clear_cache_before_run(
    name: str, initialized: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeAccelerator(name)
    collected: list[int] = []
    monkeypatch.setattr(kolossos.accelerator, "get_accelerator", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)

    def collect() -> int:
        collected.append(1)
        return 0

    monkeypatch.setattr("gc.collect", collect)

    @clear_cache_before_run()
    def body(x: int, y: int = 0) -> int:
        assert collected, "gc ran before the body"
        return x + y

    assert body(1, y=2) == 3
    expected = [] if name == "cuda" and not initialized else ["empty_cache"]
    assert [c for c in fake.calls if c == "empty_cache"] == expected
    if expected:
        assert fake.calls.index("synchronize") < fake.calls.index("empty_cache")
        assert "reset_peak_memory_stats" in fake.calls


@clear_cache_before_run()
def test_clear_cache_before_run_keeps_pytest_fixtures(tmp_path: Any) -> None:
    assert tmp_path.exists()


def test_skip_if_not_enough_gpus_skips_and_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []

    @skip_if_not_enough_gpus(min_gpus=2)
    def body(x: int) -> int:
        ran.append(x)
        return x

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match="needs 2 CUDA device"):
        body(1)
    assert ran == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert body(5) == 5
    assert ran == [5]
    with pytest.raises(ValueError, match="min_gpus=-1"):
        skip_if_not_enough_gpus(-1)


_RAN_ZERO_GPU_TEST: list[bool] = []


@skip_if_not_enough_gpus(min_gpus=0)
def test_skip_if_not_enough_gpus_zero_always_runs() -> None:
    _RAN_ZERO_GPU_TEST.append(True)


def test_skip_if_not_enough_gpus_zero_ran() -> None:
    assert _RAN_ZERO_GPU_TEST == [True]


@pytest.mark.parametrize(("value", "skipped"), [(None, True), ("0", True), ("1", False)])
def test_run_on_environment_flag(
    value: str | None, skipped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv("KOLOSSOS_SOME_FLAG", raising=False)
    else:
        monkeypatch.setenv("KOLOSSOS_SOME_FLAG", value)
    mark = run_on_environment_flag(name="kolossos_some_flag")  # read upper-cased, as upstream
    assert mark.name == "skipif"
    assert mark.args == (skipped,)
    assert "KOLOSSOS_SOME_FLAG" in mark.kwargs["reason"]
    with pytest.raises(TypeError, match="name=3"):
        run_on_environment_flag(3)  # type: ignore[arg-type]


_SWEPT: list[int] = []


@parameterize("n", [1, 2])
def test_parameterize_directly_on_a_pytest_test(n: int) -> None:
    _SWEPT.append(n)


def test_parameterize_swept_every_value() -> None:
    assert _SWEPT == [1, 2]
    assert "n" not in inspect.signature(test_parameterize_directly_on_a_pytest_test).parameters


# ---------------------------------------------------------------- seed_all and spawn


def _draw() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_all_repeats_every_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "deterministic", cudnn.deterministic)  # restored afterwards
    monkeypatch.setattr(cudnn, "benchmark", cudnn.benchmark)
    seed_all(7)
    first = _draw()
    assert (cudnn.deterministic, cudnn.benchmark) == (False, True)
    seed_all(7, cuda_deterministic=True)
    assert _draw() == first
    assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
    seed_all(8)
    assert _draw() != first
    with pytest.raises(ValueError, match="seed=-1"):
        seed_all(-1)


def test_spawn_rejects_conflicting_nprocs_before_starting() -> None:
    with pytest.raises(ValueError, match="world_size=3 and nprocs=2"):
        spawn(print, 3, nprocs=2)
    with pytest.raises(ValueError, match="world_size=0"):
        spawn(print, nprocs=0)
