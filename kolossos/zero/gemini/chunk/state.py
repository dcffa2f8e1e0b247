"""The life cycle of one tensor inside a chunk: :class:`TensorState` and its transition table.

A chunk is gathered, released and reduced as a unit, but each of its tensors is used by a
different module at a different time. The state of a tensor says where it is in the current
iteration; the chunk reads the states of all its tensors to decide whether it may be released
(nothing is using it) or reduced (every trainable tensor has its gradient).

::

    FREE ──gather──▶ HOLD ──pre-forward──▶ COMPUTE ──post-forward──▶ HOLD_AFTER_FWD
      ▲                 │                     │  ▲                        │
      │                 └─────────────────────┼──┼── pre-backward ────────┘
      │                                       ▼  │
      └──release── HOLD_AFTER_BWD ◀──reduce── READY_FOR_REDUCE (gradient in the chunk)
"""

from __future__ import annotations

import enum

__all__ = ["TRANSITIONS", "InvalidTransitionError", "TensorState", "check_transition"]


class TensorState(enum.Enum):
    """Where a chunk tensor is in the current iteration."""

    FREE = "free"
    """The chunk is not gathered: the parameter's data is an empty placeholder."""
    COMPUTE = "compute"
    """A module using the tensor is running (forward or backward): its data must stay valid."""
    HOLD = "hold"
    """The data is valid (the chunk is gathered) and nothing uses it right now."""
    HOLD_AFTER_FWD = "hold_after_fwd"
    """Used by this iteration's forward; its data is valid and will be needed by backward."""
    HOLD_AFTER_BWD = "hold_after_bwd"
    """Its gradient of this backward has been reduced into the chunk's gradient shard."""
    READY_FOR_REDUCE = "ready_for_reduce"
    """Its gradient sits in the chunk's gradient payload, waiting for the chunk's reduction."""


_S = TensorState

#: Allowed transitions: state -> the states it may move to. Anything else is a bug.
TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    # gathered (for compute or by a prefetch); a late gradient may reach a released chunk
    _S.FREE: frozenset({_S.HOLD, _S.COMPUTE, _S.READY_FOR_REDUCE}),
    _S.HOLD: frozenset({_S.COMPUTE, _S.FREE, _S.READY_FOR_REDUCE, _S.HOLD_AFTER_BWD}),
    # post-forward; gradient computed; nested use (a module calling a shared submodule);
    # end of an iteration without gradient (inference, frozen tensors)
    _S.COMPUTE: frozenset({_S.HOLD_AFTER_FWD, _S.READY_FOR_REDUCE, _S.COMPUTE, _S.HOLD}),
    _S.HOLD_AFTER_FWD: frozenset({_S.COMPUTE, _S.FREE, _S.READY_FOR_REDUCE, _S.HOLD}),
    # another contribution to the same gradient (a parameter used in two backward passes)
    _S.READY_FOR_REDUCE: frozenset({_S.HOLD_AFTER_BWD, _S.READY_FOR_REDUCE}),
    # released; recomputation or a late gradient (reentrant activation checkpointing)
    _S.HOLD_AFTER_BWD: frozenset({_S.FREE, _S.HOLD, _S.COMPUTE, _S.READY_FOR_REDUCE}),
}


class InvalidTransitionError(RuntimeError):
    """A tensor was asked to move between two states the table does not connect."""


def check_transition(old: TensorState, new: TensorState) -> None:
    """Raise :class:`InvalidTransitionError` unless ``old -> new`` is in :data:`TRANSITIONS`.

    Example:
        >>> check_transition(TensorState.FREE, TensorState.HOLD)
        >>> check_transition(TensorState.COMPUTE, TensorState.FREE)
        Traceback (most recent call last):
        ...
        kolossos.zero.gemini.chunk.state.InvalidTransitionError: ...
    """
    if new not in TRANSITIONS[old]:
        raise InvalidTransitionError(
            f"tensor state {old.name} -> {new.name} is not allowed (from {old.name} only "
            f"{sorted(s.name for s in TRANSITIONS[old])}); this is a bug in Gemini's hooks."
        )
