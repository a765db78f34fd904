"""Sizes in bytes as users write them: a number of bytes, or a number with a unit (40GiB,
512MiB, 64GB, 1.5TiB, 1e9; case does not matter). ``autopar.plan(memory_budget=...)`` and
``autopar report --memory-budget`` take them; :func:`format_bytes` writes them back."""

from __future__ import annotations

import re

#: Units, lower case: powers of 1024 (KiB to TiB) and of 1000 (KB to TB).
BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """The bytes ``text`` names; ValueError, saying what to write, when it names none (or
    less than one byte)."""
    m = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*",
                     text)
    unit = m and BYTE_UNITS.get(m.group(2).lower() or "b")
    if not unit or float(m.group(1)) * unit < 1:
        raise ValueError(f"`{text}` is not a size: give bytes or a number with a unit, such as "
                         "40GiB, 512MiB or 64GB")
    return int(float(m.group(1)) * unit)


def format_bytes(n: float) -> str:
    """``n`` bytes in the unit that fits (B, KiB, MiB, GiB, TiB), three significant digits
    or so: a 1-byte budget reads "1 B", not "0.0 MiB"."""
    if not n == n or n in (float("inf"), float("-inf")):
        return f"{n} B"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"
    return f"{n:.0f} B"
