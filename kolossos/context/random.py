"""Colossal-AI's old import path ``colossalai.context.random``."""

from kolossos.legacy.context.random import (
    add_seed,
    get_current_mode,
    get_seeds,
    get_states,
    moe_set_seed,
    reset_seeds,
    seed,
    set_mode,
    set_seed_states,
    sync_states,
    with_seed,
)

__all__ = [
    "add_seed",
    "get_current_mode",
    "get_seeds",
    "get_states",
    "moe_set_seed",
    "reset_seeds",
    "seed",
    "set_mode",
    "set_seed_states",
    "sync_states",
    "with_seed",
]
