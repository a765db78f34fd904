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
    if unit and float(m.group(1)) * unit < 1:
        raise ValueError(f"`{text}` is less than one byte: give a positive size, such as "
                         "40GiB, 512MiB or 64GB")
    if not unit:
        raise ValueError(f"`{text}` is not a size: give bytes or a number with a unit, such as "
                         "40GiB, 512MiB or 64GB")
    return int(float(m.group(1)) * unit)


def format_bytes(n: float) -> str:
    """``n`` bytes in the unit that fits it: ``512 B``, ``10.0 KiB``, ``2.7 MiB``, ``1.50 GiB``."""
    if not n == n or n in (float("inf"), float("-inf")):
        return f"{n} B"
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit in ("GiB", "TiB") and abs(n) < 10 else f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_seconds(t: float) -> str:
    """``t`` seconds in the unit that fits it: ``26.9 us``, ``1.263 ms``, ``2.500 s``."""
    if abs(t) >= 1.0:
        return f"{t:.3f} s"
    return f"{t * 1e3:.3f} ms" if abs(t) >= 1e-4 else f"{t * 1e6:.1f} us"


def format_flops(n: float) -> str:
    """``n`` floating-point operations in the unit that fits them: ``45.8 MFLOP``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                        ("kFLOP", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.{1 if abs(v) >= 10 else 2}f} {unit}"
    return f"{n:.0f} FLOP"
