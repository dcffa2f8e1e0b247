"""The signature pins of ``tests/compat/test_api_signatures*.py`` as a Markdown table.

``docs/compat.md`` embeds the table between two markers; ``test_compat_doc.py`` checks that it is
current, so the document cannot claim a signature the tests do not pin. Regenerate with
``python tests/compat/compat_pins.py --write``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "compat.md"
START, END = "<!-- pins:start -->", "<!-- pins:end -->"


def _pins(path: Path) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"_pins_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pins: dict[str, Any] = module.PINS
    return pins


def table() -> str:
    """One row per pinned name: the pin file's area, the name, the pinned parameters."""
    rows = ["| area | name | pinned parameters |", "|---|---|---|"]
    for path in sorted(HERE.glob("test_api_signatures*.py")):
        area = path.stem.removeprefix("test_api_signatures").lstrip("_") or "booster generation"
        for name, pin in sorted(_pins(path).items()):
            params = ", ".join(pin[1]) if pin[1] else "(none)"
            rows.append(f"| {area} | `{name}` | `{params}` |")
    return "\n".join(rows)


def embedded() -> str:
    """The table as ``docs/compat.md`` holds it now."""
    text = DOC.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip()


def write() -> None:
    """Replace the table in ``docs/compat.md`` by the current one."""
    text = DOC.read_text()
    head, tail = text[: text.index(START) + len(START)], text[text.index(END) :]
    DOC.write_text(f"{head}\n{table()}\n{tail}")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    else:
        print(table())
