"""Collective overlap: the simulated step of autopar's compiled plan with overlap on and off.

``python -m benchmarks.overlap`` plans and compiles (from ShapeDtypeStructs, nothing runs) a
wide BERT on an 8-way model axis and a GPT 13B-like model on (4, 2), each with
``overlap=True`` and ``overlap=False``, and prints per program: autopar's estimate, the
rewrites taken, the compiled collectives, and the simulated timeline on the h100 profile
(``cost_model.timeline.simulate``) read two ways:

* as compiled: XLA:CPU compiles every collective synchronously, so the simulation holds
  compute while any collective runs, and nothing overlaps;
* as a GPU schedules it (:func:`as_async`): every collective split into a start, issued as
  soon as its operands are ready, and a done, waited for at its first use, as XLA:GPU's
  latency-hiding scheduler runs async collectives. Kernels are the CPU-compiled ones (their
  bf16-to-f32 converts included).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_LINE = re.compile(r"^(?P<indent>\s*)(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")


def _collective(rest: str):
    """(result type, opcode, the text after the opcode) of a synchronous collective, or None."""
    from autopar.cost_model.hlo_ir import split_type
    result_type, after = split_type(rest)
    opcode = after.split("(", 1)[0].strip()
    if opcode not in _KINDS:
        return None
    return result_type, opcode, after[after.index("(") + 1:]


def _uses(rest: str, name: str) -> bool:
    return re.search(rf"%{re.escape(name)}\b(?![.\-\w])", rest) is not None


def as_async(hlo_text: str) -> str:
    """``hlo_text`` with every synchronous collective made an async start/done pair: the
    start right after its operands' producers, the done right before its first user."""
    out, block = [], None
    for line in hlo_text.splitlines():
        if block is None:
            out.append(line)
            if line.rstrip().endswith("{") and not line.startswith("HloModule"):
                block = []
            continue
        if line.strip() == "}":
            out += _reorder(block)
            out.append(line)
            block = None
        else:
            block.append(line)
    return "\n".join(out) + "\n"


def _reorder(lines: list[str]) -> list[str]:
    """One computation's lines, its collectives split into starts and dones (see
    :func:`as_async`), ordered by (position, order made)."""
    keyed, defined = [], {}  # (position, seq, line); name -> position of its definition
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        found = m and _collective(m["rest"])
        if not found:
            keyed.append((float(i), len(keyed), line))
            if m:
                defined[m["name"]] = float(i)
            continue
        result_type, opcode, tail = found
        name, indent = m["name"], m["indent"]
        operands = tail.split(")", 1)[0]
        ready = max((k for n, k in defined.items() if _uses(operands, n)), default=-1.0)
        users = [j for j in range(i + 1, len(lines)) if _uses(lines[j].split("=", 1)[-1], name)]
        done_at = (users[0] if users else len(lines)) - 0.5
        start_type = result_type if opcode == "all-reduce" else f"({result_type}, {result_type})"
        keyed.append((ready + 0.25, len(keyed),
                      f"{indent}%{name}.start = {start_type} {opcode}-start({tail}"))
        keyed.append((done_at, len(keyed), f"{indent}{m['root'] or ''}%{name} = "
                                           f"{result_type} {opcode}-done(%{name}.start)"))
        defined[name] = done_at
    return [line for _, _, line in sorted(keyed)]
