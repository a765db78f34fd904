"""Roofline time of one kernel of a compiled HLO module, on one device of a hardware profile.

A kernel (a fusion, a dot, a custom-call, any op that is not bookkeeping) takes
``max(matmul time, bytes moved / achieved HBM bandwidth, launch_overhead_s)``:

* matmul time: each dot, convolution or cuBLAS gemm custom-call in it (through fused and
  called computations) at the profile's peak for its operand type
  (``HardwareProfile.matmul_flops``: a float32 one below HIGHEST precision at TF32's on a
  GPU) times the matmul efficiency of its (M, N, K)
  (``cost_model.compute.matmul_efficiency``). Other flops are not counted: elementwise
  work is bound by the bytes.
* achieved HBM bandwidth: ``HardwareProfile.achieved_hbm_bytes_per_s``.
* bytes moved: the operands read and the result written, each once (a fusion's intermediate
  values stay on chip). Slicing ops read only what they return; a dynamic-update-slice or
  scatter writes its update in place and does not read the buffer it updates (so does a
  fusion whose root is one, and a fusion operand that is only sliced, or only updated in
  place, is read that much).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from autopar.cost_model.compute import matmul_efficiency
from autopar.cost_model.hlo_ir import (
    Instruction,
    Module,
    array_dims,
    elements,
    tuple_elements,
    type_bytes,
)

# Ops that launch no kernel: their value is another's, or a constant of the program.
FREE_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
    "replica-id", "after-all", "opt-barrier", "add-dependency", "domain", "copy-start",
    "copy-done", "send", "send-done", "recv", "recv-done",
})
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
# In-place ops -> the operand holding what they write into their operand 0.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
# A fusion's kernel; XLA:GPU runs some in-place dynamic-update-slice fusions as an async
# ``fusion-start`` (its result tuple holds the operands, then the fusion's result) and
# ``fusion-done``, which launches nothing.
_FUSIONS = frozenset({"fusion", "fusion-start"})
_GEMM_TARGET = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:gemm|matmul)')
_JSON_DIMS = r'"{}":\[(?P<dims>[^\]]*)\]'
# HLO's dot and convolution attribute, or a cuBLAS custom-call's backend config.
_HIGHEST = re.compile(r'operand_precision=\{highest|"operand_precision":\["HIGHEST"')
_DIM_LABELS = re.compile(r"dim_labels=[^_]+_(?P<kernel>[^-]+)->")
# HLO element types -> the profile's dtype names (hardware.HardwareProfile.peak_flops).
_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
           "s8": "int8", "u8": "uint8"}


@dataclass(frozen=True)
class Matmul:
    """One contraction: its flops, operand element type and per-device (M, N, K)."""

    flops: float
    dtype: str  # profile dtype name
    dims: tuple[int, int, int] | None
    highest: bool = False  # precision=HIGHEST: a float32 one runs at the float32 rate


def _dtype(hlo_type: str) -> str:
    return "float8_e4m3fn" if hlo_type.startswith("f8") else _DTYPES.get(hlo_type, "float32")


def _contraction(out_type: str, lhs_type: str | None, contracting, batch) -> Matmul | None:
    out, lhs = array_dims(out_type), array_dims(lhs_type) if lhs_type else None
    if out is None or lhs is None:
        return None
    k = math.prod(lhs[1][d] for d in contracting)
    b = math.prod(lhs[1][d] for d in batch)
    m = math.prod(s for d, s in enumerate(lhs[1]) if d not in contracting and d not in batch)
    n = math.prod(out[1]) // max(b * m, 1)
    return Matmul(flops=2.0 * math.prod(out[1]) * k, dtype=_dtype(lhs[0]), dims=(m, n, k))


def _json_dims(attributes: str, key: str) -> tuple[int, ...]:
    found = re.search(_JSON_DIMS.format(key), attributes)
    return tuple(int(d) for d in re.findall(r"\d+", found["dims"])) if found else ()


def _convolution(module: Module, computation: str, instruction: Instruction) -> Matmul | None:
    kernel = array_dims(module.type_of(computation, instruction.operands[1]) or "")
    labels = _DIM_LABELS.search(instruction.attributes)
    if kernel is None or labels is None or "o" not in labels["kernel"]:
        return None
    per_output = math.prod(kernel[1]) // kernel[1][labels["kernel"].index("o")]
    flops = 2.0 * elements(instruction.result_type) * per_output
    return Matmul(flops=flops, dtype=_dtype(kernel[0]), dims=None)


def matmuls(module: Module, computation: str, instruction: Instruction) -> list[Matmul]:
    """The contractions an instruction runs, through the computations it calls."""
    found = _matmuls(module, computation, instruction)
    if not found or instruction.opcode in _FUSIONS or instruction.opcode == "call":
        return found
    highest = bool(_HIGHEST.search(instruction.attributes))
    return [dataclasses.replace(m, highest=highest) for m in found]


def _matmuls(module: Module, computation: str, instruction: Instruction) -> list[Matmul]:
    op = instruction.opcode
    lhs = module.type_of(computation, instruction.operands[0]) if instruction.operands else None
    if op == "dot":
        found = _contraction(instruction.result_type, lhs, instruction.dims("lhs_contracting_dims"),
                             instruction.dims("lhs_batch_dims"))
        return [found] if found else []
    if op == "convolution":
        found = _convolution(module, computation, instruction)
        return [found] if found else []
    if op == "custom-call" and _GEMM_TARGET.search(instruction.attributes):
        out = tuple_elements(instruction.result_type)[0]  # (result, workspace)
        found = _contraction(out, lhs, _json_dims(instruction.attributes,
                                                  "lhs_contracting_dimensions"),
                             _json_dims(instruction.attributes, "lhs_batch_dimensions"))
        return [found] if found else []
    if op in _FUSIONS or op == "call":
        callee = (instruction.called("calls") or instruction.called("to_apply") or ("",))[0]
        return [m for inner in module.computations.get(callee, ())
                for m in matmuls(module, callee, inner)]
    return []


def _fused_reads(module: Module, fused: str, index: int, full_bytes: int,
                 round_trips: bool = False) -> int:
    """Bytes a fusion reads of its operand ``index`` (see the module docstring)."""
    body = module.computations.get(fused, ())
    param = next((i for i in body if i.opcode == "parameter" and i.operands == (str(index),)),
                 None)
    users = [i for i in body if param is not None and param.name in i.operands]
    if users and all(u.opcode in _SLICING and u.operands[0] == param.name for u in users):
        return sum(type_bytes(u.result_type) for u in users)
    if users and all(u.opcode in _IN_PLACE and u.operands[0] == param.name for u in users):
        return 0
    if round_trips and param is not None and param.name in _round_trip_buffers(body):
        return 0
    return full_bytes


def _written(module: Module, computation: str, instruction: Instruction,
             round_trips: bool = False) -> int:
    """Bytes an instruction writes: its result, or the updates of an in-place root."""
    if instruction.opcode in _IN_PLACE:
        return _update_bytes(module, computation, instruction)
    if instruction.opcode not in _FUSIONS:
        return type_bytes(instruction.result_type)
    result_type = _fusion_result_type(instruction)
    fused = instruction.called("calls")[0]
    body = {i.name: i for i in module.computations.get(fused, ())}
    parts = _root_parts(body)
    if parts is None:
        return type_bytes(result_type)
    written = 0
    for p in parts:
        trip = _round_trip(body, p) if round_trips and p.opcode not in _IN_PLACE else None
        if p.opcode in _IN_PLACE:
            written += _update_bytes(module, fused, p)
        elif trip is not None:  # the update, at the result's element size
            update = module.type_of(fused, trip.operands[_IN_PLACE[trip.opcode]])
            written += type_bytes(p.result_type) * elements(update) // max(
                elements(p.result_type), 1)
        else:
            written += type_bytes(p.result_type)
    return written


def _root_parts(body: dict[str, Instruction]) -> list[Instruction] | None:
    """What a fused computation returns: its root, or the operands of a root tuple; None
    where the root or a part is not found."""
    root = next((i for i in body.values() if i.root), None)
    if root is None:
        return None
    parts = [body.get(name) for name in root.operands] if root.opcode == "tuple" else [root]
    return None if any(p is None for p in parts) else parts


def _through_converts(body: dict[str, Instruction], instruction: Instruction | None):
    while instruction is not None and instruction.opcode == "convert":
        instruction = body.get(instruction.operands[0])
    return instruction


def _round_trip(body: dict[str, Instruction], part: Instruction) -> Instruction | None:
    """The in-place op under ``part`` when ``part`` converts it back to the element type of
    the parameter its buffer was converted from: XLA:CPU's 16-bit update carried in float32,
    exact, which XLA:GPU and TPU compile as an update in place."""
    op = _through_converts(body, part)
    if op is part or op is None or op.opcode not in _IN_PLACE:
        return None
    buffer = _through_converts(body, body.get(op.operands[0]))
    if buffer is None or buffer.opcode != "parameter" or \
            array_dims(buffer.result_type)[0] != array_dims(part.result_type)[0]:
        return None
    return op


def _round_trip_buffers(body) -> set[str]:
    """Parameters a fusion updates in place through a convert round trip (:func:`_round_trip`)."""
    by_name = {i.name: i for i in body}
    found = set()
    for p in _root_parts(by_name) or ():
        op = _round_trip(by_name, p)
        if op is not None:
            found.add(_through_converts(by_name, by_name.get(op.operands[0])).name)
    return found


def _fusion_result_type(instruction: Instruction) -> str:
    """The type a fusion computes: a ``fusion-start``'s is the second of its tuple."""
    if instruction.opcode == "fusion-start":
        parts = tuple_elements(instruction.result_type)
        return parts[1] if len(parts) > 1 else instruction.result_type
    return instruction.result_type


def _update_bytes(module: Module, computation: str, instruction: Instruction) -> int:
    update = instruction.operands[_IN_PLACE[instruction.opcode]]
    return type_bytes(module.type_of(computation, update))


def bytes_moved(module: Module, computation: str, instruction: Instruction,
                round_trips: bool = False) -> int:
    """HBM bytes a kernel reads and writes (see the module docstring). ``round_trips``: price
    an update XLA:CPU carries through a convert round trip as the update in place a GPU or
    TPU compiles (:func:`_round_trip`)."""
    if instruction.opcode in _SLICING:
        return 2 * type_bytes(instruction.result_type)
    written = _written(module, computation, instruction, round_trips)
    read = 0
    for index, operand in enumerate(instruction.operands):
        full = type_bytes(module.type_of(computation, operand))
        if instruction.opcode in _IN_PLACE and index == 0:
            full = 0
        elif instruction.opcode in _FUSIONS:
            full = _fused_reads(module, instruction.called("calls")[0], index, full, round_trips)
        read += full
    return read + written


def kernel_time_s(module: Module, computation: str, instruction: Instruction, profile,
                  dtype=None) -> float:
    """Roofline time of one kernel; ``dtype`` (a profile dtype name or jnp dtype) prices
    every matmul at that rate instead of its operands' type."""
    matmul_s = sum(m.flops / (profile.matmul_flops(dtype if dtype is not None else m.dtype,
                                                   m.highest)
                              * matmul_efficiency(profile, m.dims))
                   for m in matmuls(module, computation, instruction))
    # A GPU or TPU profile (collectives beside compute) prices XLA:CPU's round-trip updates
    # as the in-place updates its backend compiles.
    accelerator = profile.async_collectives
    memory_s = (bytes_moved(module, computation, instruction, round_trips=accelerator)
                / profile.achieved_hbm_bytes_per_s)
    return max(matmul_s, memory_s, profile.launch_overhead_s)
