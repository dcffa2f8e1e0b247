"""``LazyInitContext`` in one process: nothing allocated while building, values identical to the
eager build bit for bit (random draws, reseeds, explicit generators, rejection sampling, tied
weights, buffers), the global random state untouched, memory of a partial materialisation
bounded by what is kept, and clear errors for what cannot be recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.accelerator.memory_tracker import TensorMemoryTracker
from kolossos.booster import Booster
from kolossos.lazy import (
    LazyInitContext,
    LazyTensor,
    is_lazy,
    is_lazy_module,
    materialize_module,
    replay_tensors,
)
from kolossos.models import resnet18, vit_tiny

transformers = pytest.importorskip("transformers")
SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4}  # fmt: skip

MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=16)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=99, num_key_value_heads=2, **SMALL)
    ),
    "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=99, **SMALL)),
    "vit": lambda: transformers.ViTForImageClassification(
        transformers.ViTConfig(image_size=16, patch_size=8, num_labels=5, **SMALL)
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=99,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
        )
    ),
    "resnet18": lambda: resnet18(num_classes=10),
    "vit_tiny": lambda: vit_tiny(10, image_size=32, patch_size=8),
}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer, the non-persistent ones (rotary tables) included."""
    state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
    state.update({f"buffer:{k}": v for k, v in model.named_buffers()})
    return state


@pytest.mark.parametrize("name", sorted(MODELS))
def test_lazy_equals_eager_bit_for_bit(name: str) -> None:
    torch.manual_seed(11)
    eager = MODELS[name]()
    after_eager = torch.get_rng_state()
    torch.manual_seed(11)
    with LazyInitContext():
        lazy = MODELS[name]()
    # everything but torch.tensor(data) constants (BatchNorm's step counter) is unallocated
    assert all(t.is_meta for t in _state(lazy).values() if t.is_floating_point())
    assert isinstance(next(lazy.parameters()), LazyTensor)
    before = torch.get_rng_state()
    LazyInitContext.materialize(lazy)
    assert torch.equal(torch.get_rng_state(), before), "materialising drew from the global RNG"
    assert not torch.equal(after_eager, before)  # the eager build did draw
    expected, got = _state(eager), _state(lazy)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
        assert expected[key].stride() == got[key].stride(), key
    assert not is_lazy_module(lazy)
    torch.manual_seed(12)  # and the check can fail
    other = _state(MODELS[name]())
    assert any(not torch.equal(other[k], got[k]) for k in got if got[k].is_floating_point())


def test_tied_weights_stay_tied_and_parameters_keep_their_identity() -> None:
    torch.manual_seed(0)
    with LazyInitContext():
        model: Any = MODELS["gpt2"]()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    LazyInitContext.materialize(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert optimizer.param_groups[0]["params"][0] is params[0] and not params[0].is_meta


def _draws() -> nn.Module:
    """Reseeds, an explicit generator, rejection sampling and QR inside one build."""
    gen = torch.Generator().manual_seed(5)
    a = nn.Linear(8, 8)
    torch.manual_seed(99)  # a reseed in the middle of the build
    b = nn.Linear(8, 8)
    nn.init.normal_(b.weight, generator=gen)
    nn.init.trunc_normal_(a.weight, std=0.5)  # draws a value-dependent count of numbers
    nn.init.orthogonal_(b.weight)
    c = nn.Linear(8, 8)
    c.weight.data[0].zero_()  # partial write on a view
    c.bias.data.mul_(3).add_(torch.tensor(1.0))
    return nn.Sequential(a, b, c)


def test_reseeds_generators_and_whole_init_calls() -> None:
    torch.manual_seed(1)
    eager = _state(_draws())
    torch.manual_seed(1)
    with LazyInitContext():
        lazy = _draws()
    LazyInitContext.materialize(lazy)
    for key, value in _state(lazy).items():
        assert torch.equal(value, eager[key]), key


def test_partial_materialisation_keeps_only_what_is_asked() -> None:
    """A rank keeping a quarter of each tensor peaks near that quarter plus one tensor in flight
    — never near the whole model, although every random draw of the model is replayed."""
    config = transformers.LlamaConfig(vocab_size=512, num_key_value_heads=4, num_hidden_layers=4,
                                      hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4)  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    full_bytes = sum(p.numel() * 4 for p in eager.parameters())
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = transformers.LlamaForCausalLM(config)

    def quarter(name: str, tensor: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return full.reshape(-1)[: max(1, full.numel() // 4)].clone()

    with TensorMemoryTracker() as tracker:
        materialize_module(lazy, keep=quarter)
    largest = max(p.numel() * 4 for p in eager.parameters())
    kept = sum(t.numel() * t.element_size() for t in _state(lazy).values())
    assert kept < full_bytes / 3
    assert tracker.peak_bytes <= kept + 3 * largest, (tracker.peak_bytes, kept, largest)
    for name, param in eager.named_parameters():
        assert torch.equal(lazy.get_parameter(name), quarter(name, param, param.detach())), name


def test_replay_tensors_delivers_in_construction_order() -> None:
    torch.manual_seed(0)
    with LazyInitContext():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    seen: list[int] = []
    params = list(model.parameters())
    replay_tensors(params[::-1], lambda index, value: seen.append(index))
    assert sorted(seen) == [0, 1, 2, 3] and is_lazy(params[0])


def test_what_cannot_be_recorded_is_refused_clearly() -> None:
    with LazyInitContext():
        layer = nn.Linear(4, 4)
        with pytest.raises(RuntimeError, match="values"):
            layer.weight.sum().item()
        real = torch.zeros(4, 4, device="cpu").to("meta")  # a meta tensor of no context
    ordinary = torch.zeros(3)
    with LazyInitContext():
        lazy = torch.ones(3)
        with pytest.raises(RuntimeError, match="ordinary tensor"):
            ordinary.copy_(lazy)
    moved = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="not built inside LazyInitContext"):
        LazyInitContext.materialize(moved)
    assert real.is_meta
    with pytest.raises(NotImplementedError, match="tensor_cls"):
        LazyInitContext(tensor_cls=torch.Tensor)
    with pytest.raises(TypeError, match="default_device"):
        LazyInitContext(default_device=3.5)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"booster\.boost"):
        LazyInitContext.distribute(layer, None, {})
    context = LazyInitContext()
    with context, pytest.raises(NotImplementedError, match="twice"):
        context.__enter__()


def test_resume_records_the_cut_of_a_shard() -> None:
    """What a tensor-parallel plugin does: cut a slice of a lazy weight after the build."""
    torch.manual_seed(3)
    eager = nn.Linear(8, 6)
    torch.manual_seed(3)
    with LazyInitContext():
        lazy = nn.Linear(8, 6)
    with LazyInitContext.resume(lazy):
        lazy.weight = nn.Parameter(lazy.weight.detach().chunk(2, dim=0)[1].contiguous())
    LazyInitContext.materialize(lazy)
    assert torch.equal(lazy.weight, eager.weight.chunk(2, dim=0)[1])
    assert torch.equal(lazy.bias, eager.bias)


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_booster_without_a_plugin_materialises_the_model(mixed_precision: str | None) -> None:
    """No plugin (or a mixed-precision recipe applied before the plugin): the Booster itself
    materialises the whole model before moving or casting it."""
    torch.manual_seed(4)
    eager = MODELS["llama"]()
    torch.manual_seed(4)
    with LazyInitContext():
        lazy = MODELS["llama"]()
    booster = Booster(mixed_precision=mixed_precision)
    model, *_ = booster.boost(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1))
    assert not is_lazy_module(model)
    got = _state(lazy)
    for name, value in _state(eager).items():
        assert torch.equal(got[name], value), name
