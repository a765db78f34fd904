"""The instructions of compiled HLO text, by computation, with their operands and types.

:func:`parse_module` reads ``Compiled.as_text()`` (one instruction per line, as jax prints it)
into a :class:`Module`: each computation's instructions in printed order (the schedule of a
module printed with ``is_scheduled=true``), each with its name, result type, opcode, operand
names and the attribute text after its operands. The compiled text prints operands by name
only, so an operand's type is the result type of the instruction of that name in the same
computation (:meth:`Module.type_of`). :func:`shape_bytes` sizes a type.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION = re.compile(
    r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_OPCODE = re.compile(r"\s*(?P<opcode>[\w\-]+)\(")
_ARRAYS = re.compile(r"(?P<dtype>[a-z]\w*)\[(?P<dims>[<=\d,]*)\]")
_BITS_IN_DTYPE = re.compile(r"[fsu](?P<bits>\d+)")  # f32 -> 32, s8 -> 8, f8e4m3fn -> 8
_CALLED = re.compile(r"(?:^|[\s,])(?P<attr>[a-z_]+)=(?P<value>\{[^}]*\}|%?[\w.\-]+)")
_NAME = re.compile(r"%?([\w.\-]+)")
_DIMS_ATTR = r"(?:^|[\s,]){}=\{{(?P<dims>[\d,]*)\}}"

# Bits per element where the dtype name does not start with them as f32, s8 and f8e4m3fn do.
_SPECIAL_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0}


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction line."""

    name: str
    result_type: str  # "f32[8,128]{1,0}", or a tuple "(f32[2]{0}, s32[])"
    opcode: str
    operands: tuple[str, ...]  # operand instruction names, in order
    attributes: str  # the text after the operand list: "channel_id=1, replica_groups=..."
    line: str
    root: bool

    def called(self, attribute: str) -> tuple[str, ...]:
        """The computations named by ``attribute`` (``calls``, ``body``, ``to_apply``, ...)."""
        for match in _CALLED.finditer(self.attributes):
            if match["attr"] == attribute:
                return tuple(_NAME.findall(match["value"]))
        return ()

    def dims(self, attribute: str) -> tuple[int, ...]:
        """A ``name={1,2}`` integer-list attribute (``lhs_contracting_dims``), () if absent."""
        found = re.search(_DIMS_ATTR.format(re.escape(attribute)), self.attributes)
        return tuple(int(d) for d in found["dims"].split(",") if d) if found else ()


@dataclass(frozen=True)
class Module:
    """The computations of one HLO module; ``entry`` names the ENTRY computation."""

    computations: dict[str, tuple[Instruction, ...]]
    entry: str
    types: dict[str, dict[str, str]]  # computation -> instruction name -> result type

    def type_of(self, computation: str, name: str) -> str | None:
        """Result type of instruction ``name`` in ``computation`` (None if there is none)."""
        return self.types.get(computation, {}).get(name)


def split_type(rest: str) -> tuple[str, str]:
    """Split ``(f32[2], s32[]) all-reduce(...)`` into the result type and what follows."""
    if not rest.startswith("("):
        result_type, _, after = rest.partition(" ")
        return result_type, after
    depth = 0
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    raise ValueError(f"unbalanced tuple type in HLO: {rest!r}")


def _operand_list(text: str) -> tuple[str, str]:
    """Split ``%a, %b), attrs`` (text after the opcode's parenthesis) at its closing one."""
    depth = 1
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return text[:i], text[i + 1 :].lstrip(", ")
    return text, ""


def _operand_names(text: str) -> tuple[str, ...]:
    """Names in an operand list; each top-level item's last token (``f32[2] %x`` -> x)."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            item = text[start:i].strip()
            if item:
                names.append(item.split()[-1].lstrip("%"))
            start = i + 1
    return tuple(names)


def parse_module(hlo_text: str) -> Module:
    """Every computation of ``hlo_text`` and its instructions, in printed order."""
    computations: dict[str, list[Instruction]] = {}
    current, entry = "", ""
    for line in hlo_text.splitlines():
        if found := _INSTRUCTION.match(line):
            result_type, after = split_type(found["rest"])
            if opcode := _OPCODE.match(after):
                operands, attributes = _operand_list(after[opcode.end():])
                computations.setdefault(current, []).append(Instruction(
                    name=found["name"], result_type=result_type, opcode=opcode["opcode"],
                    operands=_operand_names(operands), attributes=attributes,
                    line=line.strip(), root=bool(found["root"])))
        elif header := _COMPUTATION.match(line):
            current = header["name"]
            entry = current if header["entry"] else entry
    return Module(computations={name: tuple(found) for name, found in computations.items()},
                  entry=entry,
                  types={name: {i.name: i.result_type for i in found}
                         for name, found in computations.items()})


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d.removeprefix("<=")) for d in text.split(",") if d)  # "<=8": its bound


def array_dims(type_str: str) -> tuple[str, tuple[int, ...]] | None:
    """(element type, dims) of an array type ``f32[8,128]{1,0}``; None for a tuple."""
    found = _ARRAYS.match(type_str)
    return (found["dtype"], _dims(found["dims"])) if found else None


def tuple_elements(type_str: str) -> list[str]:
    """Top-level elements of a tuple type; a non-tuple type is its own single element."""
    if not type_str.startswith("("):
        return [type_str]
    found, depth, start = [], 0, 1
    for i, char in enumerate(type_str):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if (char == "," and depth == 1) or depth == 0:
            found.append(type_str[start:i].strip())
            start = i + 1
    return found


def _element_bits(dtype: str) -> int:
    if dtype in _SPECIAL_BITS:
        return _SPECIAL_BITS[dtype]
    bits = _BITS_IN_DTYPE.match(dtype)
    if not bits:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(bits["bits"])


def shape_bytes(type_str: str) -> int:
    """Bytes of an HLO type: an array like ``f32[8,128]{1,0}`` or a tuple of them."""
    return sum(_element_bits(a["dtype"]) * math.prod(_dims(a["dims"]))
               for a in _ARRAYS.finditer(type_str)) // 8


def elements(type_str: str | None) -> int:
    """Elements of an array type (0 for None or a tuple)."""
    array = array_dims(type_str) if type_str else None
    return math.prod(array[1]) if array else 0


def type_bytes(type_str: str | None) -> int:
    """:func:`shape_bytes`, 0 for None (an operand of unknown type)."""
    return shape_bytes(type_str) if type_str else 0
