"""Colossal-AI's ZeRO / Gemini behaviours on two gloo ranks.

* ``LowLevelZeroOptimizer(master_weights=False)`` trains a bf16 model like torch's SGD / Adam
  stepping the bf16 parameters in one process, with no fp32 copy;
* a torch optimizer's state dict loads into ``LowLevelZeroOptimizer`` and ``state_dict()`` gives
  it back (and training continues like the torch optimizer's);
* ``GeminiDDP.state_dict(only_rank_0=...)`` holds the unsharded model's values, and
  ``load_state_dict`` / ``get_static_torch_model`` agree with it;
* ``search_chunk_configuration`` / ``init_chunk_manager`` key the result by the group's size.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.testing import distributed
from kolossos.testing.parity import TinyMLP, make_classification_batches, shard
from kolossos.zero import GeminiDDP, GeminiOptimizer, LowLevelZeroOptimizer, get_static_torch_model
from kolossos.zero.gemini.chunk import init_chunk_manager, search_chunk_configuration

BATCH = 8
# each rank rounds its half-batch gradients in bf16
BF16_RTOL, BF16_ATOL = 2e-2, 1.5e-2


def _torch_optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2, eps=1e-3)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


@distributed(2)
def test_master_weights_false_trains_like_the_torch_optimizer() -> None:
    rank = dist.get_rank()
    batches = make_classification_batches(4, BATCH)
    for kind, stage, offload in [("sgd", 1, False), ("adam", 2, False), ("adam", 2, True)]:
        torch.manual_seed(0)
        reference = TinyMLP().to(torch.bfloat16)
        model = copy.deepcopy(reference)
        ref_opt = _torch_optimizer(kind, list(reference.parameters()))
        opt = LowLevelZeroOptimizer(
            _torch_optimizer(kind, list(model.parameters())),
            partition_grad=stage == 2,
            cpu_offload=offload,
            reduce_bucket_size=100,
            master_weights=False,
        )
        master = opt.master_params()[0]
        assert master.dtype == torch.bfloat16  # no fp32 copy
        if not offload:  # the optimizer steps this rank's slice of the model's weights
            assert master.untyped_storage().data_ptr() == opt.flat_work[0].data_ptr()
        for x, y in batches:
            opt.backward(_loss(model, shard(x, rank, 2), shard(y, rank, 2)))
            opt.step()
            opt.zero_grad()
            _loss(reference, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        states = [v for v in opt.optim.state[master].values() if v.dim()]
        assert states and all(v.dtype == torch.bfloat16 for v in states), kind
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=BF16_RTOL, atol=BF16_ATOL,
                                       msg=f"{kind} stage {stage}: {name}")  # fmt: skip
        untrained = TinyMLP().to(torch.bfloat16).parameters()
        for p, q in zip(model.parameters(), untrained, strict=True):
            assert not torch.equal(p, q)  # trained


def _assert_same_state(got: dict, expected: dict, exact: bool = True) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert list(got["state"]) == list(expected["state"])
    for index, state in expected["state"].items():
        assert list(got["state"][index]) == list(state)
        for key, value in state.items():
            tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(got["state"][index][key], value, **tol)


@distributed(2)
def test_torch_optimizer_state_dict_loads_and_round_trips() -> None:
    rank = dist.get_rank()
    batches = make_classification_batches(3, BATCH)
    for stage in (1, 2):
        torch.manual_seed(0)
        reference = TinyMLP()
        ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, weight_decay=0.1)
        for x, y in batches[:2]:
            _loss(reference, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        saved = copy.deepcopy(ref_opt.state_dict())
        model = copy.deepcopy(reference)
        opt = LowLevelZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.5),
                                    partition_grad=stage == 2, reduce_bucket_size=100)  # fmt: skip
        opt.load_state_dict(saved)
        assert opt.optim.param_groups[0]["lr"] == 1e-2 and opt.optim.param_groups[0]["params"]
        _assert_same_state(opt.state_dict(), saved)
        plain = torch.optim.Adam(copy.deepcopy(reference).parameters())
        plain.load_state_dict(opt.state_dict())
        _assert_same_state(plain.state_dict(), saved)
        # the loaded states drive the next step exactly as the torch optimizer's
        x, y = batches[2]
        opt.backward(_loss(model, shard(x, rank, 2), shard(y, rank, 2)))
        opt.step()
        _loss(reference, x, y).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        _assert_same_state(opt.state_dict(), ref_opt.state_dict(), exact=False)
    # without master weights the states live in the working dtype: a torch state dict is cast
    model = TinyMLP().to(torch.bfloat16)
    opt = LowLevelZeroOptimizer(torch.optim.Adam(model.parameters()), master_weights=False)
    opt.load_state_dict(saved)
    out = opt.state_dict()
    for index, state in saved["state"].items():
        torch.testing.assert_close(out["state"][index]["exp_avg"], state["exp_avg"].bfloat16())


class TiedNet(nn.Module):
    """Embedding, a layer, a tied output head, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("offset", torch.linspace(-1, 1, 6))
        self.register_buffer("scratch", torch.zeros(6), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids) + self.offset)))


def _gemini_step(model: nn.Module, opt: object, ids: torch.Tensor) -> None:
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
    if isinstance(opt, GeminiOptimizer):
        opt.backward(loss)
    else:
        loss.backward()
    opt.step()  # type: ignore[attr-defined]
    opt.zero_grad()  # type: ignore[attr-defined]


@distributed(2)
def test_gemini_state_dict_holds_the_unsharded_values() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = TiedNet()
    model = copy.deepcopy(reference)
    config, total, _ = search_chunk_configuration(model, search_range_m=1, search_interval=100)
    assert list(config) == [2] and total == sum(p.numel() for p in reference.parameters())
    entry = config[2]
    entry.update(chunk_size=40, keep_gathered=False)  # several chunks, as upstream's tests do
    gemini = GeminiDDP(model, chunk_config_dict=entry, mixed_precision=torch.float32)
    opt = GeminiOptimizer(torch.optim.AdamW(gemini.parameters(), lr=1e-2), gemini)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(1))
    _gemini_step(gemini, opt, ids[2 * rank : 2 * rank + 2])
    _gemini_step(reference, ref_opt, ids)

    expected = reference.state_dict()
    full = gemini.state_dict(only_rank_0=False)
    assert list(full) == list(expected)  # torch's keys and order: head.weight, no scratch
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert full["emb.weight"].device.type == "cpu"
    first = gemini.state_dict()  # only_rank_0=True
    assert list(first) == list(expected)
    for name, value in first.items():
        if rank == 0 or name == "offset":
            torch.testing.assert_close(value, full[name], rtol=0, atol=0)
        else:
            assert value.numel() == 0, name

    other = TiedNet()
    other.get_buffer("offset").fill_(0.5)
    assert gemini.load_state_dict(other.state_dict()) == ([], [])
    for name, value in gemini.state_dict(only_rank_0=False).items():
        torch.testing.assert_close(value, other.state_dict()[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(gemini(ids), other(ids))
    plain = get_static_torch_model(gemini, only_rank_0=False)
    torch.testing.assert_close(plain(ids), other(ids))
    assert plain.get_submodule("head").weight is plain.get_submodule("emb").weight


@distributed(2)
def test_init_chunk_manager_over_two_ranks() -> None:
    model = nn.Sequential(nn.Linear(33, 33), nn.Linear(33, 7))
    manager = init_chunk_manager(model, "cpu", hidden_dim=11, search_range_m=0, min_chunk_size_m=0)
    ((degree, size),) = manager.dp_degree_chunk_size_dict.items()
    assert degree == 2 and size % 2 == 0 and size >= 33 * 33
    small = init_chunk_manager(model, "cpu", search_range_m=1)  # below 32 Mi: kept gathered
    assert [c.keep_gathered for c in small] == [True]
