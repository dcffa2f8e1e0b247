"""Pins the signatures and import paths of Colossal-AI's pipeline API (v0.3.x:
``colossalai.pipeline.stage_manager``, ``.p2p``, ``.schedule._utils``,
``.schedule.interleaved_pp``).

The notation is that of ``test_api_signatures.py``: parameters in order as ``name`` (required),
``name=<repr of default>``, ``*name`` (keyword-only). Where kolossos differs from upstream the
comment next to the pin says how and why; update a pin only on purpose.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

from kolossos.pipeline import PipelineStageManager
from kolossos.pipeline.p2p import (
    P2PMetadata,
    PipelineP2PCommunication,
    TensorMetadata,
    create_send_metadata,
)
from kolossos.pipeline.schedule import _utils
from kolossos.pipeline.schedule.interleaved_pp import InterleavedSchedule

SM = PipelineStageManager
COMM = PipelineP2PCommunication

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    # Upstream's order; kolossos' own options keyword-only after it.
    "InterleavedSchedule.__init__": (
        InterleavedSchedule.__init__,
        P(
            "stage_manager num_model_chunks=None num_microbatch=None microbatch_size=None "
            "enable_metadata_cache=True *num_microbatches=None *tensor_shape=None "
            "*tensor_dtype=torch.float32 *schedule=None"
        ),
    ),
    # Upstream: (pg_mesh, pipeline_axis, enable_interleave=False, num_model_chunks=1,
    # num_layers_per_stage=None). kolossos: pg_mesh/pipeline_axis optional (None: every process
    # forms one pipeline), the chunk placement `layout` ("loop" | "v" for ZB-V) keyword-only
    # after them; enable_interleave is implied by num_model_chunks > 1.
    "PipelineStageManager.__init__": (
        SM.__init__,
        P(
            "pg_mesh=None pipeline_axis=0 enable_interleave=False num_model_chunks=1 "
            "num_layers_per_stage=None *layout='loop'"
        ),
    ),
    # Upstream: (ignore_chunk=False). kolossos asks about an explicit chunk first (its own
    # schedules and engine pass one positionally); a bool there is read as ignore_chunk.
    "PipelineStageManager.is_first_stage": (SM.is_first_stage, P("chunk=None ignore_chunk=False")),
    "PipelineStageManager.is_last_stage": (SM.is_last_stage, P("chunk=None ignore_chunk=False")),
    "PipelineStageManager.get_rank": (SM.get_rank, []),
    "PipelineStageManager.get_prev_rank": (SM.get_prev_rank, []),
    "PipelineStageManager.get_next_rank": (SM.get_next_rank, []),
    "PipelineStageManager.get_p2p_process_group": (
        SM.get_p2p_process_group,
        P("first_rank second_rank"),
    ),
    "PipelineStageManager.init_process_group_by_stages": (
        SM.init_process_group_by_stages,
        P("stages"),
    ),
    "PipelineStageManager.switch_model_chunk_id": (SM.switch_model_chunk_id, P("model_chunk_id")),
    "PipelineStageManager.distribute_layers": (
        SM.distribute_layers,
        P("num_layers num_stages=None num_model_chunks=None"),
    ),
    # Same parameters; kolossos always returns a list of (start, end) per chunk (upstream: a
    # bare pair for one chunk).
    "PipelineStageManager.get_stage_index": (
        SM.get_stage_index,
        P("layers_per_stage stage=None num_model_chunks=None num_stages=None"),
    ),
    "PipelineP2PCommunication.__init__": (COMM.__init__, P("stage_manager")),
    "PipelineP2PCommunication.recv_forward": (
        COMM.recv_forward,
        P("prev_rank=None metadata_recv=None"),
    ),
    "PipelineP2PCommunication.recv_backward": (
        COMM.recv_backward,
        P("next_rank=None metadata_recv=None"),
    ),
    "PipelineP2PCommunication.send_forward": (
        COMM.send_forward,
        P("output_object next_rank=None send_metadata=True"),
    ),
    "PipelineP2PCommunication.send_backward": (
        COMM.send_backward,
        P("input_object prev_rank=None send_metadata=True"),
    ),
    "PipelineP2PCommunication.send_forward_recv_backward": (
        COMM.send_forward_recv_backward,
        P(
            "input_object next_rank=None send_metadata=True metadata_recv=None "
            "send_prior_fallback=None"
        ),
    ),
    "PipelineP2PCommunication.send_backward_recv_forward": (
        COMM.send_backward_recv_forward,
        P(
            "input_object prev_rank=None send_metadata=True metadata_recv=None "
            "send_prior_fallback=None"
        ),
    ),
    "PipelineP2PCommunication.p2p_communicate": (
        COMM.p2p_communicate,
        P("output_object recv_pre next_rank=None comm_dtype=torch.float16"),
    ),
    "create_send_metadata": (create_send_metadata, P("object strict=True return_tensor=False")),
    "_utils.get_batch_size": (_utils.get_batch_size, P("batch")),
    "_utils.get_micro_batch": (_utils.get_micro_batch, P("batch start micro_batch_size")),
    "_utils.merge_batch": (_utils.merge_batch, P("data batch_size_dim=0")),
    "_utils.to_device": (_utils.to_device, P("x device=None")),
    "_utils.model_forward": (_utils.model_forward, P("model data internal_inputs")),
    "_utils.retain_grad": (_utils.retain_grad, P("x")),
    "_utils.detach": (_utils.detach, P("x")),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


def test_metadata_tuples_have_upstreams_fields() -> None:
    assert TensorMetadata._fields == ("shape", "dtype", "requires_grad")
    assert P2PMetadata._fields == (
        "tree_spec",
        "tensor_metadata",
        "non_tensor_obj_idx",
        "non_tensor_objs",
    )


def test_stage_manager_properties() -> None:
    for name in ("num_stages", "prev_rank", "next_rank"):
        assert isinstance(inspect.getattr_static(SM, name), property), name


UPSTREAM_IMPORTS = [
    "kolossos.pipeline.PipelineP2PCommunication",
    "kolossos.pipeline.PipelineStageManager",
    "kolossos.pipeline.PipelineSchedule",
    "kolossos.pipeline.OneForwardOneBackwardSchedule",
    "kolossos.pipeline.InterleavedSchedule",
    "kolossos.pipeline.p2p.PipelineP2PCommunication",
    "kolossos.pipeline.p2p.create_send_metadata",
    "kolossos.pipeline.stage_manager.PipelineStageManager",
    "kolossos.pipeline.schedule.base.PipelineSchedule",
    "kolossos.pipeline.schedule.one_f_one_b.OneForwardOneBackwardSchedule",
    "kolossos.pipeline.schedule.interleaved_pp.InterleavedSchedule",
    "kolossos.pipeline.schedule._utils.get_batch_size",
    "kolossos.pipeline.schedule._utils.get_micro_batch",
    "kolossos.pipeline.schedule._utils.merge_batch",
]


@pytest.mark.parametrize("dotted", UPSTREAM_IMPORTS)
def test_upstream_import_path_resolves(dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_interleaved_schedule_takes_upstreams_positional_order() -> None:
    manager = PipelineStageManager.default(num_model_chunks=2)
    schedule = InterleavedSchedule(manager, 2, 4)
    assert schedule.config.num_microbatches == 4 and schedule.num_model_chunks == 2
    assert InterleavedSchedule(manager, num_microbatches=4).config.num_microbatches == 4
    with pytest.raises(ValueError, match="num_model_chunks=3"):
        InterleavedSchedule(manager, 3, 4)
    with pytest.raises(ValueError, match="give one"):
        InterleavedSchedule(manager, 2, 4, num_microbatches=8)
