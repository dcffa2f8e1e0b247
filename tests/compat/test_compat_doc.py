"""``docs/compat.md``'s table of pinned signatures is the one the pin tests hold."""

from __future__ import annotations

import compat_pins


def test_the_documented_pins_are_the_tested_ones() -> None:
    assert compat_pins.embedded() == compat_pins.table(), (
        "docs/compat.md is out of date: run python tests/compat/compat_pins.py --write"
    )
