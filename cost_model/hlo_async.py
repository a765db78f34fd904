"""Compiled HLO read as a latency-hiding scheduler would issue it.

XLA:CPU compiles every collective synchronously, so a CPU-compiled program shows no overlap.
:func:`as_async` splits each synchronous collective into a start, issued right after its
operands' producers, and a done, waited for right before its first user, as XLA:GPU's and
XLA:TPU's schedulers run asynchronous collectives. The kernels stay the CPU-compiled ones.
"""

from __future__ import annotations

import re

from autopar.cost_model.hlo_ir import split_type

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_LINE = re.compile(r"^(?P<indent>\s*)(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")


def _collective(rest: str):
    """(result type, opcode, the text after the opcode) of a synchronous collective, or None."""
    result_type, after = split_type(rest)
    opcode = after.split("(", 1)[0].strip()
    if opcode not in KINDS:
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
