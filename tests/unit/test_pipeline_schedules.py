"""Schedule tables (pure functions), the simulator, micro-batching and the split backward."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from kolossos.pipeline import PipelineStageManager
from kolossos.pipeline.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    GPipeSchedule,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineSchedule,
    ScheduleSpec,
    ScheduleTable,
    ZeroBubbleH1Schedule,
    ZeroBubbleVSchedule,
    build_table,
    check_num_chunks,
    create_schedule,
    register_schedule,
    schedule_names,
    schedule_spec,
    unregister_schedule,
)
from kolossos.pipeline.schedule.microbatch import (
    first_stage_call,
    loss_target,
    merge_outputs,
    split_batch,
)
from kolossos.pipeline.schedule.split_backward import backward_input, backward_weight
from kolossos.pipeline.schedule.table import validate_table
from kolossos.pipeline.schedule.tables import gpipe_bubble, gpipe_table
from kolossos.pipeline.simulate import (
    Costs,
    DeadlockError,
    closed_form_bubble,
    format_gantt,
    main,
    simulate,
)

F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]


def tables() -> list[ScheduleTable]:
    out = []
    for name in SCHEDULES:
        for p, m in SIZES:
            if name == "interleaved" and m % p:
                continue
            out.append(build_table(name, p, m))
    return out


ALL = tables()


@pytest.mark.parametrize("table", ALL, ids=lambda t: f"{t.name}-p{t.pp_size}-m{t.num_microbatches}")
def test_table_is_complete_ordered_and_deadlock_free(table: ScheduleTable) -> None:
    validate_table(table)  # counts, and F before B before W per micro-batch and chunk
    kinds = 3 if table.split_backward else 2
    for actions in table.ranks:
        assert len(actions) == kinds * table.num_chunks * table.num_microbatches
        counts = Counter(a.kind for a in actions)
        assert counts[F] == counts[B] == table.num_chunks * table.num_microbatches
        assert counts[W] == (counts[F] if table.split_backward else 0)
    timeline = simulate(table)  # raises on a cyclic wait
    for rank, spans in enumerate(timeline.spans):
        starts = [s for s, _ in spans]
        assert starts == sorted(starts), f"rank {rank} runs out of table order"
    for src in range(table.pp_size):  # what src sends to dst is what dst consumes from src
        for dst in range(table.pp_size):
            if src == dst:
                continue
            sent = Counter(table.messages(src, dst))
            needed = Counter(
                msg
                for a in table.ranks[dst]
                if (msg := table.needs(dst, a)) is not None
                and table.owner_of(msg.stage - 1 if msg.kind == "act" else msg.stage + 1)[0] == src
            )
            assert sent == needed


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_bubble_matches_closed_form(name: str) -> None:
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16), (3, 6)]:
        table = build_table(name, p, m)
        expected = closed_form_bubble(name, p, m, table.num_chunks)
        assert expected is not None
        assert simulate(table).bubble_fraction == pytest.approx(expected, abs=1e-12)
    one_f_one_b = simulate(build_table("1f1b", 4, 8)).bubble_fraction
    if name in ("interleaved", "zbh1", "zbv"):  # each improves on 1F1B
        assert simulate(build_table(name, 4, 8)).bubble_fraction < one_f_one_b


def live_peaks(table: ScheduleTable) -> list[int]:
    """Most micro-batches alive per rank, from the table: F opens, the last backward part
    closes."""
    closing = W if table.split_backward else B
    peaks = []
    for actions in table.ranks:
        live = peak = 0
        for a in actions:
            live += 1 if a.kind is F else (-1 if a.kind is closing else 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def test_memory_bounds_of_the_tables() -> None:
    p, m = 4, 16
    assert live_peaks(build_table("1f1b", p, m)) == [4, 3, 2, 1]
    assert live_peaks(build_table("gpipe", p, m)) == [m] * p
    assert live_peaks(build_table("zbh1", p, m)) == [p] * p  # 1F1B's rank-0 peak everywhere
    assert max(live_peaks(build_table("zbv", p, m))) <= 2 * p  # chunk units: p whole micro-batches
    for v in (2, 3):  # Megatron's warm-up plus the one forward of the steady state
        expected = [min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)]
        assert live_peaks(build_table("interleaved", p, m, v)) == expected
    one = build_table("1f1b", p, m)
    for r, actions in enumerate(one.ranks):  # warm-up forwards, then strict alternation
        warm = p - r - 1
        assert all(a.kind is F for a in actions[:warm])
        assert [a.kind for a in actions[warm : warm + 4]] == [F, B, F, B]


def test_interleaved_order_and_validation() -> None:
    table = build_table("interleaved", 2, 4, 2)
    assert [str(a) for a in table.ranks[0][:6]] == ["F0", "F1", "F0c1", "F1c1", "F2", "B0c1"]
    assert table.stage_of(1, 1) == 3 and table.owner_of(2) == (0, 1)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        build_table("interleaved", 4, 6)
    with pytest.raises(ValueError, match="runs 2 model chunk"):
        build_table("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_table("pipedream", 2, 4)


def test_zbv_plans_for_the_costs_it_is_given() -> None:
    from kolossos.pipeline.schedule.zero_bubble import zbv_table

    costs = (1.0, 1.5, 0.5)  # a cheap weight gradient, as measured on small blocks
    measured = Costs(forward=1.0, input_grad=1.5, weight_grad=0.5)
    planned = simulate(zbv_table(4, 8, costs), measured).bubble_fraction
    assert planned < 0.5 * simulate(zbv_table(4, 8), measured).bubble_fraction
    with pytest.raises(ValueError, match="three positive"):
        zbv_table(4, 8, (1.0, 0.0, 1.0))


def test_zbv_uses_the_v_layout() -> None:
    table = build_table("zbv", 4, 8)
    assert table.layout == "v" and table.split_backward
    assert table.stage_of(0, 0) == 0 and table.stage_of(0, 1) == 7  # rank 0: first and last
    assert table.stage_of(3, 0) == 3 and table.stage_of(3, 1) == 4  # the turn inside rank 3
    assert table.messages(3, 3) == []  # the turn is a local hand-off


def test_simulator_finds_deadlocks_and_bad_tables() -> None:
    ok = build_table("1f1b", 2, 2)
    # rank 1 wants micro-batch 1 first; rank 0 sends it only after micro-batch 0's backward
    cyclic = ScheduleTable(
        name="cyclic", pp_size=2, num_chunks=1, num_microbatches=2, layout="loop",
        split_backward=False,
        ranks=((Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1)),
               (Action(F, 0, 1), Action(F, 0, 0), Action(B, 0, 0), Action(B, 0, 1))),
    )  # fmt: skip
    validate_table(cyclic)
    with pytest.raises(DeadlockError, match="cycle"):
        simulate(cyclic)
    backwards_first = ScheduleTable(
        name="bad", pp_size=2, num_chunks=1, num_microbatches=2, layout="loop",
        split_backward=False, ranks=(ok.ranks[0], tuple(reversed(ok.ranks[1]))),
    )  # fmt: skip
    with pytest.raises(ValueError, match="out of order"):
        validate_table(backwards_first)
    missing = ScheduleTable(
        name="bad", pp_size=2, num_chunks=1, num_microbatches=2, layout="loop",
        split_backward=False, ranks=(ok.ranks[0], ok.ranks[1][:-1]),
    )  # fmt: skip
    with pytest.raises(ValueError, match="missing"):
        validate_table(missing)
    with pytest.raises(ValueError, match="must be >= 0"):
        Costs(forward=-1)


def test_costs_and_communication_change_the_timeline() -> None:
    table = build_table("1f1b", 2, 4)
    base = simulate(table)
    assert base.makespan == 15  # (m + p - 1) * (F + B)
    assert simulate(table, Costs(comm=0.5)).makespan > base.makespan
    gantt = format_gantt(base)
    assert gantt.splitlines()[0] == "rank  0 |FF..BBFBBFBB.BB|"


def test_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble=0.2727 (closed form 0.2727)" in out and "rank  3 |" in out
    png = tmp_path / "zbv.png"
    assert main(["--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in captured.err and "pip install matplotlib" in captured.err
    else:
        assert png.stat().st_size > 0


# --- micro-batches -------------------------------------------------------------------------------
def test_split_and_merge_batches() -> None:
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    parts = split_batch((x, y), 3, None)
    assert len(parts) == 3 and torch.equal(parts[1][0], x[2:4]) and torch.equal(parts[2][1], y[4:])
    assert first_stage_call(parts[0])[0][0].shape == (2, 2) and loss_target(parts[0]).shape == (2,)
    kw = split_batch({"input_ids": x, "scale": 2.0}, None, 3)
    assert (
        len(kw) == 2
        and kw[0]["scale"] == 2.0
        and first_stage_call(kw[1])[1]["input_ids"].shape == (3, 2)
    )
    assert torch.equal(merge_outputs([p[0] for p in parts]), x)
    with pytest.raises(ValueError, match="equal micro-batches"):
        split_batch(x, 4, None)


# --- split backward ------------------------------------------------------------------------------
class Reuse(nn.Module):
    """A weight used at two depths: the split would double count, so it falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("kind", ["mlp", "reuse", "loss", "first"])
def test_split_backward_equals_plain_backward(kind: str) -> None:
    torch.manual_seed(0)
    model: nn.Module = (
        Reuse()
        if kind == "reuse"
        else nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
    )
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=kind != "first")
    xr = x.detach().clone().requires_grad_(kind != "first")
    grad = None if kind == "loss" else torch.randn(4, 8)
    out, ref_out = model(x), ref(xr)
    if kind == "loss":
        out, ref_out = out.pow(2).mean(), ref_out.pow(2).mean()
    ref_out.backward(grad)
    in_grads, work = backward_input([out], [grad], [x], list(model.parameters()))
    assert work.split == (kind != "reuse")
    if work.split:  # B left every weight gradient to W
        assert all(p.grad is None for p in model.parameters())
    backward_weight(work)
    if kind != "first":
        torch.testing.assert_close(in_grads[0], xr.grad)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_schedule_config_and_single_process_runner() -> None:
    """Validation before any communication; a one-stage pipeline runs without a process group
    and equals plain training."""
    from kolossos.pipeline.schedule import ScheduleConfig

    with pytest.raises(ValueError, match="exactly one of"):
        ScheduleConfig(num_microbatches=2, microbatch_size=2)
    with pytest.raises(ValueError, match="positive int"):
        ScheduleConfig(num_microbatches=0)
    manager = PipelineStageManager.default()
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        create_schedule("pipedream", manager, num_microbatches=2)
    with pytest.raises(ValueError, match="layout='v'"):
        create_schedule("zbv", PipelineStageManager.default(num_model_chunks=2), num_microbatches=2)
    v_manager = PipelineStageManager.default(num_model_chunks=2, layout="v")
    with pytest.raises(ValueError, match="three positive"):
        create_schedule("zbv", v_manager, num_microbatches=2, costs=(1.0, 0.0, 1.0))
    zbv = create_schedule("zbv", v_manager, num_microbatches=2, costs=(1.0, 1.5, 0.5))
    assert zbv.table(2).layout == "v" and zbv.costs == (1.0, 1.5, 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    runner = create_schedule("zbh1", manager, microbatch_size=2)
    assert runner.bubble_bound(3) == 0.0
    out = runner.forward_backward_step(model, iter([(x, y)]), nn.functional.mse_loss,
                                       return_outputs=True)  # fmt: skip
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(out["loss"], ref_loss)
    torch.testing.assert_close(out["outputs"], ref(x).detach())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert runner.last_stats is not None and runner.last_stats.peak_live == 1


# --- the registry --------------------------------------------------------------------------------
def train_one_step(runner: PipelineSchedule) -> None:
    """One single-process step of ``runner`` equals plain training."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    out = runner.forward_backward_step(model, iter([(x, y)]), nn.functional.mse_loss)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(out["loss"], ref_loss)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_registered_schedule_is_available_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    """A table builder plus one registration: build_table, create_schedule and the simulator
    take the new name with no other change; unregistering restores the registry."""
    before = dict(SCHEDULES)
    toy = ScheduleSpec(name="toy-gpipe", builder=lambda p, m, v: gpipe_table(p, m),
                       closed_form=gpipe_bubble)  # fmt: skip
    assert register_schedule(toy) is toy
    try:
        assert "toy-gpipe" in schedule_names() and schedule_spec("toy-gpipe") is toy
        table = build_table("toy-gpipe", 3, 4)
        assert table.name == "toy-gpipe" and table.ranks == build_table("gpipe", 3, 4).ranks
        runner = create_schedule("toy-gpipe", PipelineStageManager.default(), num_microbatches=3)
        assert type(runner) is PipelineSchedule and runner.name == "toy-gpipe"
        assert runner.spec is toy and runner.table(3).name == "toy-gpipe"
        train_one_step(runner)
        assert main(["--schedule", "toy-gpipe", "--pp", "2", "--microbatches", "4"]) == 0
        assert "toy-gpipe: pp=2 microbatches=4 chunks=1 makespan=15 bubble=0.2000 (closed form " \
            "0.2000)" in capsys.readouterr().out  # fmt: skip
        with pytest.raises(SystemExit):
            main(["--help"])
        assert "toy-gpipe" in capsys.readouterr().out
        with pytest.raises(ValueError, match="already registered"):
            register_schedule(toy)
    finally:
        assert unregister_schedule("toy-gpipe") is toy
    assert dict(SCHEDULES) == before and "toy-gpipe" not in schedule_names()
    with pytest.raises(ValueError, match="unknown pipeline schedule 'toy-gpipe'"):
        build_table("toy-gpipe", 3, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'toy-gpipe'"):
        create_schedule("toy-gpipe", PipelineStageManager.default(), num_microbatches=3)
    with pytest.raises(SystemExit):
        main(["--schedule", "toy-gpipe"])
    assert "invalid choice: 'toy-gpipe'" in capsys.readouterr().err
    assert closed_form_bubble("toy-gpipe", 2, 4) is None


def test_classes_follow_their_registration() -> None:
    expected = {"gpipe": GPipeSchedule, "1f1b": OneForwardOneBackwardSchedule,
                "interleaved": InterleavedSchedule, "zbh1": ZeroBubbleH1Schedule,
                "zbv": ZeroBubbleVSchedule}  # fmt: skip
    assert set(schedule_names()) == set(expected)
    for name, cls in expected.items():
        spec = schedule_spec(name)
        manager = PipelineStageManager.default(num_model_chunks=spec.default_chunks,
                                               layout=spec.layout)  # fmt: skip
        runner = create_schedule(name, manager, num_microbatches=2)
        assert type(runner) is cls and runner.spec is spec and runner.name == name
        assert (runner.layout, runner.split_backward) == (spec.layout, spec.split_backward)
        table = runner.table(2)
        assert table.layout == spec.layout and table.split_backward == spec.split_backward
        assert table.ranks == build_table(name, 1, 2, spec.default_chunks).ranks
    assert (
        schedule_spec("zbv").fixed_chunks == 2 and schedule_spec("interleaved").fixed_chunks is None
    )
    runner = PipelineSchedule(PipelineStageManager.default(), 2, schedule="zbh1")  # no class needed
    assert runner.split_backward and runner.table(2).name == "zbh1"
    with pytest.raises(ValueError, match="runs schedule '1f1b', got schedule='gpipe'"):
        OneForwardOneBackwardSchedule(PipelineStageManager.default(), 2, schedule="gpipe")
    with pytest.raises(ValueError, match="num_model_chunks=2; set num_model_chunks=1"):
        create_schedule(
            "1f1b", PipelineStageManager.default(num_model_chunks=2), num_microbatches=2
        )
    with pytest.raises(NotImplementedError, match="override build_table"):
        PipelineSchedule(PipelineStageManager.default(), 2).table(2)


def test_registry_validation_messages() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown pipeline schedule 'pipedream'; choose one of "
        r"\['1f1b', 'gpipe', 'interleaved', 'zbh1', 'zbv'\].*register_schedule",
    ):
        schedule_spec("pipedream")
    assert check_num_chunks("zbv", None) == 2 and check_num_chunks("interleaved", 5) == 5
    with pytest.raises(
        ValueError,
        match=r"got num_model_chunks=3; set num_model_chunks=2, or use a "
        r"schedule that takes any count \('interleaved'\)",
    ):
        check_num_chunks("zbv", 3, arg="num_model_chunks")
    with pytest.raises(ValueError, match="num_chunks=0 must be an int >= 1"):
        check_num_chunks("interleaved", 0)
    with pytest.raises(ValueError, match="layout='ring' is unknown"):
        ScheduleSpec(name="bad", builder=lambda p, m, v: gpipe_table(p, m), layout="ring")
    with pytest.raises(ValueError, match="default_chunks=1 differs from fixed_chunks=2"):
        ScheduleSpec(name="bad", builder=lambda p, m, v: gpipe_table(p, m), fixed_chunks=2)
    with pytest.raises(ValueError, match="non-empty string"):
        ScheduleSpec(name="", builder=lambda p, m, v: gpipe_table(p, m))
    with pytest.raises(TypeError, match="takes a ScheduleSpec"):
        register_schedule(("toy", gpipe_table))  # type: ignore[arg-type]
    lying = ScheduleSpec(
        name="lying", builder=lambda p, m, v: gpipe_table(p, m), split_backward=True
    )
    register_schedule(lying)
    try:
        with pytest.raises(ValueError, match="its registration says"):
            build_table("lying", 2, 2)
    finally:
        unregister_schedule("lying")
    assert "lying" not in SCHEDULES
