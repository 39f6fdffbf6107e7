"""The one spelling of an expert projection's name in plans, sensitivity tables and importance files:
``layers.I.moe.gate_up.E`` / ``layers.I.moe.down.E`` -> ``(I, 'gate_up' | 'down', E)``."""
from __future__ import annotations

import re

from ..errors import FormatError
from ..numbers import whole

NAME = re.compile(r"^layers\.(0|[1-9][0-9]{0,8})\.moe\.(gate_up|down)\.(0|[1-9][0-9]{0,8})$", re.ASCII)
_LOOSE = re.compile(r"^layers\.([^.]*)\.moe\.(gate_up|down)\.([^.]*)$", re.S)


def key_of(name, where: str = "plan") -> tuple[int, str, int]:
    """``layers.3.moe.down.5`` -> ``(3, 'down', 5)``. Layer and expert are ASCII digits with no leading zero (one
    spelling per expert projection), at most 9 of them; FormatError naming ``where`` otherwise."""
    name = str(name)
    m = NAME.match(name)
    if m is not None:
        return int(m.group(1)), m.group(2), int(m.group(3))
    loose = _LOOSE.match(name)
    shown = name if len(name) <= 60 else name[:57] + "..."
    if loose is not None:
        for part, what in ((loose.group(1), "layer"), (loose.group(3), "expert")):
            whole(part, f"{where}: {shown!r}: the {what} number", 0, 999_999_999, canonical=True, error=FormatError)
    raise FormatError(f"{where}: {shown!r} is not an expert projection (layers.I.moe.gate_up.E or layers.I.moe.down.E)")
