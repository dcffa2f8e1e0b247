"""Checkpoint formats in one process: round trips, shard sizes, detection, strictness, bad files."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from kolossos.checkpoint_io import (
    OPTIM_FORMAT_VERSION,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    GeneralCheckpointIO,
    register_param_names,
)
from kolossos.checkpoint_io.backends import read_tensor_file

pytest.importorskip("safetensors")


class Net(nn.Module):
    """Linear layers, a BatchNorm (buffers) and a tied output layer."""

    def __init__(self, width: int = 16, vocab: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.fc1(self.embed(x))))
        return self.head(torch.relu(self.fc2(h)))


def make(seed: int, **kw: int) -> Net:
    torch.manual_seed(seed)
    net = Net(**kw)
    net.train()
    net(torch.randint(0, 12, (8,)))  # moves BatchNorm statistics away from their defaults
    return net


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


@pytest.fixture
def io() -> GeneralCheckpointIO:
    return GeneralCheckpointIO()


# --------------------------------------------------------------------------- model round trips
@pytest.mark.parametrize("use_safetensors", [False, True])
@pytest.mark.parametrize("layout", ["file", "dir", "sharded"])
def test_model_round_trip(io, tmp_path, layout, use_safetensors) -> None:
    src, dst = make(0), make(1)
    path = tmp_path / ("ckpt.bin" if layout == "file" else "ckpt")
    if layout == "dir":
        path.mkdir()
    io.save_model(
        src, path, shard=layout == "sharded", size_per_shard=0.001, use_safetensors=use_safetensors
    )
    report = io.load_model(dst, path)
    assert report.ok
    assert_same_state(src, dst)
    assert dst.head.weight is dst.embed.weight  # tying survives the load


def test_file_names_and_index(io, tmp_path) -> None:
    model = make(0)
    io.save_model(model, tmp_path / "st", shard=True, size_per_shard=0.001, use_safetensors=True)
    io.save_model(model, tmp_path / "pt", shard=True, size_per_shard=0.001)
    st_names, pt_names = sorted(os.listdir(tmp_path / "st")), sorted(os.listdir(tmp_path / "pt"))
    n = len(st_names) - 1
    assert st_names[:-1] == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert st_names[-1] == "model.safetensors.index.json"
    assert pt_names[-1] == "pytorch_model.bin.index.json"
    assert pt_names[0] == f"pytorch_model-00001-of-{len(pt_names) - 1:05d}.bin"
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state) - {"head.weight"}  # tied weight stored once
    unique = [t for k, t in state.items() if k != "head.weight"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in unique)
    # safetensors shards carry the metadata Hugging Face checks
    from safetensors import safe_open

    with safe_open(str(tmp_path / "st" / st_names[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("use_safetensors", [False, True])
def test_shard_size_limit(io, tmp_path, use_safetensors) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])  # weights 4 KiB, biases 128 B
    limit_mb = 10 / 1024  # 10 KiB: two weights (+ biases) fit, three do not
    io.save_model(
        model, tmp_path / "c", shard=True, size_per_shard=limit_mb, use_safetensors=use_safetensors
    )
    index_name = (
        "model.safetensors.index.json" if use_safetensors else "pytorch_model.bin.index.json"
    )
    weight_map = json.loads((tmp_path / "c" / index_name).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) == 3
    for file in files:
        tensors = read_tensor_file(tmp_path / "c" / file)
        assert set(tensors) == {n for n, f in weight_map.items() if f == file}
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 10 * 1024
    loaded = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    io.load_model(loaded, tmp_path / "c")
    assert_same_state(model, loaded)


def test_oversized_tensor_gets_its_own_shard(io, tmp_path) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(4, 4))  # 16 KiB weight > 8 KiB limit
    io.save_model(model, tmp_path / "c", shard=True, size_per_shard=8 / 1024)
    weight_map = json.loads((tmp_path / "c" / "pytorch_model.bin.index.json").read_text())
    assert weight_map["weight_map"]["0.weight"] != weight_map["weight_map"]["0.bias"]


# --------------------------------------------------------------------------- detection, prefix
def test_load_detects_every_layout(io, tmp_path) -> None:
    src = make(0)
    io.save_model(src, tmp_path / "a", shard=True, size_per_shard=0.001, use_safetensors=True)
    io.save_model(src, tmp_path / "b.weights", use_safetensors=True)  # extension says nothing
    io.save_model(src, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="use_safetensors"):
        io.save_model(src, tmp_path / "d.safetensors")
    torch.save(src.state_dict(), tmp_path / "d.safetensors")  # a torch file despite its name
    for path in (
        tmp_path / "a",
        tmp_path / "a" / "model.safetensors.index.json",
        tmp_path / "b.weights",
        tmp_path / "c.pt",
        tmp_path / "d.safetensors",
    ):
        dst = make(1)
        io.load_model(dst, path)
        assert_same_state(src, dst)


def test_prefix(io, tmp_path) -> None:
    a, b = make(0), make(1)
    io.save_model(a, tmp_path / "c", shard=True, prefix="ep1", size_per_shard=0.001)
    names = os.listdir(tmp_path / "c")
    assert "ep1-pytorch_model.bin.index.json" in names
    assert all(n.startswith("ep1-pytorch_model") for n in names)
    dst = make(2)
    io.load_model(dst, tmp_path / "c")  # the only checkpoint in the directory: found
    assert_same_state(a, dst)
    io.save_model(b, tmp_path / "c", shard=True, prefix="ep2", use_safetensors=True)
    assert "ep1-pytorch_model.bin.index.json" in os.listdir(tmp_path / "c")  # kept
    with pytest.raises(CheckpointError, match="several model checkpoints"):
        io.load_model(dst, tmp_path / "c")
    io.load_model(dst, tmp_path / "c" / "ep2-model.safetensors.index.json")
    assert_same_state(b, dst)
    io.load_model(dst, tmp_path / "c" / "ep1-pytorch_model.bin.index.json")
    assert_same_state(a, dst)
    with pytest.raises(ValueError, match="prefix"):
        io.save_model(a, tmp_path / "c", shard=True, prefix="x/y")


def test_resave_replaces_old_shards_and_keeps_other_files(io, tmp_path) -> None:
    big, small = make(0, width=64), make(1, width=64)
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    register_param_names(opt, big)
    path = tmp_path / "c"
    io.save_model(big, path, shard=True, size_per_shard=0.005)
    io.save_optimizer(opt, path, shard=True)  # same directory: the model must survive
    (path / "notes.txt").write_text("mine")
    n_before = len([n for n in os.listdir(path) if n.startswith("pytorch_model-")])
    io.save_model(small, path, shard=True, size_per_shard=1, use_safetensors=True)
    names = set(os.listdir(path))
    assert not any(n.startswith("pytorch_model") for n in names), names  # old format gone
    assert n_before > 1 and "model-00001-of-00001.safetensors" in names
    assert {"notes.txt", "pytorch_optim.bin.index.json", "pytorch_optim_group.bin"} <= names
    assert not any("kolossos" in n for n in os.listdir(tmp_path))  # no staging leftovers
    dst = make(2, width=64)
    io.load_model(dst, path)
    assert_same_state(small, dst)
    io.load_optimizer(opt, path)


# --------------------------------------------------------------------------- strictness
def test_strict_lists_every_problem_and_loads_nothing(io, tmp_path) -> None:
    src = make(0)
    io.save_model(src, tmp_path / "c", shard=True, size_per_shard=0.001)

    class Other(Net):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(16, 16, bias=False)  # fc1.bias unexpected
            self.fc2 = nn.Linear(16, 16)
            self.fc2.weight = nn.Parameter(torch.zeros(16, 8))  # wrong shape
            self.extra = nn.Linear(2, 2)  # extra.weight / extra.bias missing

    dst = Other()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        io.load_model(dst, tmp_path / "c")
    message = str(info.value)
    for text in ("extra.weight", "extra.bias", "fc1.bias", "fc2.weight", "[16, 16] vs [16, 8]"):
        assert text in message
    assert "c" in message and "strict=False" in message
    report = info.value.report
    assert set(report.missing_keys) == {"extra.weight", "extra.bias"}
    assert report.unexpected_keys == ("fc1.bias",)
    for name, value in dst.state_dict().items():  # nothing was loaded
        assert torch.equal(value, before[name]), name


def test_non_strict_loads_the_rest_and_reports(io, tmp_path, caplog) -> None:
    src = make(0)
    io.save_model(src, tmp_path / "c.bin")
    dst = Net()
    dst.fc2 = nn.Linear(16, 16, bias=False)
    with caplog.at_level(logging.WARNING, logger="kolossos.checkpoint_io"):
        report = io.load_model(dst, tmp_path / "c.bin", strict=False)
    assert report.unexpected_keys == ("fc2.bias",) and not report.missing_keys
    assert torch.equal(dst.fc2.weight, src.fc2.weight)
    assert torch.equal(dst.norm.running_mean, src.norm.running_mean)


# --------------------------------------------------------------------------- bad files
def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x17" * len(data))
    else:
        path.write_bytes(data[:8] + b"\xff" * 64 + data[72:])  # clobbered header


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "header"])
@pytest.mark.parametrize("use_safetensors", [False, True])
def test_corrupt_shard_names_the_file(io, tmp_path, how, use_safetensors) -> None:
    io.save_model(
        make(0), tmp_path / "c", shard=True, size_per_shard=0.001, use_safetensors=use_safetensors
    )
    shard = sorted(p for p in (tmp_path / "c").iterdir() if not p.name.endswith(".json"))[-1]
    _corrupt(shard, how)
    dst = make(1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointError, match=shard.name):
        io.load_model(dst, tmp_path / "c")
    for name, value in dst.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_bad_index_and_missing_files(io, tmp_path) -> None:
    io.save_model(make(0), tmp_path / "c", shard=True, size_per_shard=0.001)
    index = tmp_path / "c" / "pytorch_model.bin.index.json"
    body = index.read_text()
    index.write_text(body[: len(body) // 2])
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin.index.json"):
        io.load_model(make(1), tmp_path / "c")
    index.write_text(body)
    first = sorted((tmp_path / "c").glob("pytorch_model-00001-of-*.bin"))[0]
    first.unlink()
    with pytest.raises(CheckpointError, match=first.name):
        io.load_model(make(1), tmp_path / "c")
    with pytest.raises(CheckpointNotFoundError):
        io.load_model(make(1), tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no model checkpoint"):
        io.load_model(make(1), tmp_path / "empty")


class _Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch EVIL_RAN",))


def test_loading_never_runs_code(io, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"fc1.weight": torch.zeros(1), "x": _Evil()}, tmp_path / "evil.bin")
    with pytest.raises(CheckpointError, match=r"evil.bin"):
        io.load_model(make(0), tmp_path / "evil.bin")
    with pytest.raises(CheckpointError, match=r"evil.bin"):
        io.load_optimizer(torch.optim.SGD(make(0).parameters(), lr=1), tmp_path / "evil.bin")
    assert not (tmp_path / "EVIL_RAN").exists()


def test_argument_errors(io, tmp_path) -> None:
    model = make(0)
    with pytest.raises(ValueError, match="size_per_shard"):
        io.save_model(model, tmp_path / "c", shard=True, size_per_shard=0)
    with pytest.raises(TypeError, match="size_per_shard"):
        io.save_model(model, tmp_path / "c", shard=True, size_per_shard="1GB")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="shard=True"):
        io.save_model(model, tmp_path / "f", shard=True)


# --------------------------------------------------------------------------- optimizer
def _trained(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    model = make(seed)
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if "bias" in n], "lr": 0.01},
            {"params": [p for n, p in model.named_parameters() if "bias" not in n]},
        ],
        lr=0.02,
        weight_decay=0.1,
    )
    register_param_names(opt, model)
    for _ in range(2):
        model(torch.randint(0, 12, (8,))).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, value in sa["state"][k].items():
            torch.testing.assert_close(sb["state"][k][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["file", "dir", "sharded"])
def test_optimizer_round_trip(io, tmp_path, layout) -> None:
    _, opt = _trained(0)
    _, fresh = _trained(1)
    path = tmp_path / ("o.bin" if layout == "file" else "o")
    if layout == "dir":
        path.mkdir()
    io.save_optimizer(opt, path, shard=layout == "sharded", size_per_shard=0.002)
    if layout == "sharded":
        names = set(os.listdir(path))
        assert {"pytorch_optim.bin.index.json", "pytorch_optim_group.bin"} <= names
        assert len([n for n in names if n.startswith("pytorch_optim-")]) > 1
        meta = json.loads((path / "pytorch_optim.bin.index.json").read_text())["metadata"]
        assert meta["version"] == OPTIM_FORMAT_VERSION
        for shard in {n for n in names if n.startswith("pytorch_optim-")}:
            body = torch.load(path / shard, weights_only=True)
            size = sum(t.numel() * t.element_size() for s in body.values() for t in s.values())
            assert size <= 0.002 * 2**20 or len(body) == 1
    assert io.load_optimizer(fresh, path).ok
    _assert_same_optimizer(opt, fresh)


def test_optimizer_is_keyed_by_name(io, tmp_path) -> None:
    model, opt = _trained(0)
    io.save_optimizer(opt, tmp_path / "o", shard=True, size_per_shard=0.002)
    # the same parameters in another order and grouping: matched by name
    other = make(1)
    params = dict(other.named_parameters())
    reordered = torch.optim.AdamW(
        [
            {"params": [params[n] for n in reversed(list(params)) if "bias" not in n]},
            {"params": [params[n] for n in reversed(list(params)) if "bias" in n], "lr": 5.0},
        ],
        lr=5.0,
    )
    register_param_names(reordered, other)
    io.load_optimizer(reordered, tmp_path / "o")
    for name, param in other.named_parameters():
        mine = reordered.state[param]
        theirs = opt.state[dict(model.named_parameters())[name]]
        torch.testing.assert_close(mine["exp_avg"], theirs["exp_avg"], rtol=0, atol=0)
    assert reordered.param_groups[0]["lr"] == 0.02 and reordered.param_groups[1]["lr"] == 0.01


def test_optimizer_mismatch_errors(io, tmp_path) -> None:
    _, opt = _trained(0)
    io.save_optimizer(opt, tmp_path / "o.bin")
    other = Net(width=8)
    wrong = torch.optim.AdamW(other.parameters())
    register_param_names(wrong, other)
    with pytest.raises(CheckpointMismatchError, match=r"fc1.weight: \[16, 16\] vs \[8, 8\]"):
        io.load_optimizer(wrong, tmp_path / "o.bin")
    bigger = nn.Sequential(make(1), nn.Linear(2, 2))
    opt2 = torch.optim.AdamW(bigger.parameters())
    register_param_names(opt2, bigger)
    with pytest.raises(CheckpointMismatchError, match=r"missing.*unexpected"):
        io.load_optimizer(opt2, tmp_path / "o.bin")


def test_optimizer_newer_version_and_foreign_files(io, tmp_path) -> None:
    _, opt = _trained(0)
    io.save_optimizer(opt, tmp_path / "o.bin")
    body = torch.load(tmp_path / "o.bin", weights_only=True)
    body["version"] = OPTIM_FORMAT_VERSION + 1
    torch.save(body, tmp_path / "new.bin")
    with pytest.raises(CheckpointError, match=r"upgrade|Upgrade"):
        io.load_optimizer(opt, tmp_path / "new.bin")
    io.save_model(make(0), tmp_path / "m.bin")
    with pytest.raises(CheckpointError, match=r"m.bin"):
        io.load_optimizer(opt, tmp_path / "m.bin")


def test_optimizer_positional_fallback_and_torch_state_dict(io, tmp_path, caplog) -> None:
    model = make(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # never registered
    model(torch.randint(0, 12, (8,))).sum().backward()
    opt.step()
    with caplog.at_level(logging.WARNING, logger="kolossos.checkpoint_io"):
        io.save_optimizer(opt, tmp_path / "o.bin")
    assert "param_groups[i].params[j]" in caplog.text
    fresh = torch.optim.SGD(make(1).parameters(), lr=0.5, momentum=0.9)
    io.load_optimizer(fresh, tmp_path / "o.bin")
    _assert_same_optimizer(opt, fresh)
    torch.save(opt.state_dict(), tmp_path / "plain.pt")  # what torch (and upstream) writes
    fresh = torch.optim.SGD(make(1).parameters(), lr=0.5, momentum=0.9)
    io.load_optimizer(fresh, tmp_path / "plain.pt")
    _assert_same_optimizer(opt, fresh)


def test_lr_scheduler_round_trip(io, tmp_path) -> None:
    _, opt = _trained(0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    for _ in range(3):
        opt.step()
        sched.step()
    io.save_lr_scheduler(sched, tmp_path / "s.bin")
    _, opt2 = _trained(0)
    sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=10)
    io.load_lr_scheduler(sched2, tmp_path / "s.bin")
    assert sched2.state_dict() == sched.state_dict()
    with pytest.raises(CheckpointError, match=r"nope.bin"):
        io.load_lr_scheduler(sched2, tmp_path / "nope.bin")


def test_resume_matches_uninterrupted_training(io, tmp_path) -> None:
    def steps(model, opt, sched, n, seed):  # type: ignore[no-untyped-def]
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(n):
            loss = model(torch.randint(0, 12, (8,), generator=gen)).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def build(seed: int):  # type: ignore[no-untyped-def]
        model = make(seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        register_param_names(opt, model)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)

    ref = build(0)
    expected = steps(*ref, 3, seed=1) + steps(*ref, 3, seed=2)
    first = build(0)
    got = steps(*first, 3, seed=1)
    io.save_model(first[0], tmp_path / "m", shard=True, size_per_shard=0.001, use_safetensors=True)
    io.save_optimizer(first[1], tmp_path / "o", shard=True, size_per_shard=0.001)
    io.save_lr_scheduler(first[2], tmp_path / "s.bin")
    second = build(5)
    io.load_model(second[0], tmp_path / "m")
    io.load_optimizer(second[1], tmp_path / "o")
    io.load_lr_scheduler(second[2], tmp_path / "s.bin")
    got += steps(*second, 3, seed=2)
    assert got == expected  # bit-identical in one process


# --------------------------------------------------------------------------- legacy pair
def test_legacy_save_and_load_checkpoint(tmp_path) -> None:
    from kolossos.legacy.utils.checkpoint import load_checkpoint, save_checkpoint

    model, opt = _trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    opt.step()
    sched.step()
    save_checkpoint(tmp_path / "c.pt", 7, model, opt, sched, best=0.5)
    model2, opt2 = _trained(3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 2)
    assert load_checkpoint(tmp_path / "c.pt", model2, opt2, sched2) == 7
    assert_same_state(model, model2)
    _assert_same_optimizer(opt, opt2)
    assert sched2.state_dict() == sched.state_dict()
    assert torch.load(tmp_path / "c.pt", weights_only=True)["best"] == 0.5
    save_checkpoint(tmp_path / "m.pt", 1, model)  # model only, as in the docs
    assert load_checkpoint(tmp_path / "m.pt", make(4)) == 1
    with pytest.raises(CheckpointError, match="no optimizer"):
        load_checkpoint(tmp_path / "m.pt", make(4), opt2)
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "x.pt", 1, model, format=3)
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(tmp_path / "m.pt", Net(width=8))


def test_gathered_temporaries_are_never_mistaken_for_ties(tmp_path: Path) -> None:
    """A plugin's state items are often temporaries (gathered shards): once one is written and
    freed, the next one of the same size may reuse its memory. Ties must come from the live model,
    not from storage addresses, or such tensors would silently be left out."""
    from kolossos.checkpoint_io import GeneralCheckpointIO

    class Gathering(GeneralCheckpointIO):
        def model_state_items(self, model, gather_dtensor):  # type: ignore[no-untyped-def]
            for name, tensor in super().model_state_items(model, gather_dtensor):
                yield name, tensor.clone()  # a fresh temporary, freed after it is written

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    io = Gathering()
    io.save_model(model, tmp_path / "ckpt", shard=True, size_per_shard=0.02)
    fresh = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    io.load_model(fresh, tmp_path / "ckpt")  # strict: fails if any tensor was dropped
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
