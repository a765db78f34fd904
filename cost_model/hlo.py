"""Ground truth from a compiled JAX program: its collectives, flops and memory.

:func:`analyze` takes a ``jax.stages.Compiled`` (``jax.jit(f, ...).lower(*args).compile()``)
and reads three things from it:

* ``compiled.as_text()``, the optimized, SPMD-partitioned HLO. Every collective instruction
  in it becomes a :class:`Collective`: its kind, bytes per device, replica-group size, how
  many times it runs per program execution, and the computation it sits in.
* ``compiled.cost_analysis()``: per-device ``flops`` and ``bytes accessed``. It counts each
  instruction once, a loop body's too; the matmuls of the trips after the first are added up
  from the text apart (:attr:`HloSummary.flops_all_trips`).
* ``compiled.memory_analysis()``: peak, argument, output, temp and alias sizes in bytes.

Bytes on the wire per device, per execution, assume ring algorithms; ``n`` is the number of
devices in a replica group, ``B`` the bytes of the buffer named:

======================  ==========================
collective              wire bytes per device
======================  ==========================
all-reduce              2(n-1)/n · B
all-gather              (n-1)/n · B_out
reduce-scatter          (n-1)/n · B_in
all-to-all              (n-1)/n · B
collective-permute      B
======================  ==========================

``ragged-all-to-all`` is priced as an all-to-all of its whole output buffer (an upper bound).

Reading the HLO text:

* Shapes: the result type of an instruction (``f32[8,128]{1,0}``, ``bf16[]``, or a tuple of
  them for combined collectives, whose bytes add up). Output bytes come from the result;
  input bytes follow from the kind (all-gather: out/n, reduce-scatter: out·n, else out),
  because the compiled text does not print operand types.
* Async pairs: a ``*-start``/``*-done`` pair counts once, at the start. ``all-reduce-start``
  returns its outputs; every other ``*-start`` returns a tuple whose second element is the
  output (``(in, out)``, ``((ins), out, ...)`` or ``(in, out, u32[], u32[])``). A generic
  ``async-start(...), calls=%c`` is counted through the plain collective inside ``%c``.
* Replica groups (read by ``cost_model.replica_groups``, which also lists each group's
  partition ids): ``{{0,1},{2,3}}`` (size of a listed group), iota ``[2,4]<=[8]`` (second
  number), mesh axes ``mesh['a'=2,'b'=4] {'b'}`` (product of the named axis sizes; a
  sub-axis ``'b':(1)2`` counts its own size), and ``{}`` or none at all (every device:
  ``replica_count`` × ``num_partitions`` from the ``HloModule`` line). A collective-permute
  has ``source_target_pairs`` instead; its group size is the number of devices named there
  and is not used for bytes; each pair is one of its groups.
* Trip counts: a computation used as a ``while`` body runs ``known_trip_count`` times per
  execution of its caller (its condition one time more), nested loops multiply, and
  computations reached several ways add up. A loop without ``known_trip_count`` counts as 1
  and marks the collectives under it ``trip_count_known=False``. Conditional branches count
  as 1 each (an upper bound: only one runs).

Instructions are read one per line, as ``Compiled.as_text()`` prints them (``cost_model.hlo_ir``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from autopar.cost_model.hlo_ir import (
    Instruction,
    Module,
    array_dims,
    elements,
    parse_module,
    shape_bytes,
    tuple_elements,
)
from autopar.cost_model.hlo_roofline import matmuls
from autopar.cost_model.replica_groups import Groups, device_groups, group_size



class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


def wire_bytes(kind: CollectiveKind, in_bytes: float, out_bytes: float, n: int) -> float:
    """Bytes one device sends for one collective over a group of n devices (ring algorithms)."""
    if kind is CollectiveKind.COLLECTIVE_PERMUTE:
        return float(out_bytes)
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * frac * in_bytes
    if kind is CollectiveKind.ALL_GATHER:
        return frac * out_bytes
    return frac * in_bytes  # reduce-scatter, all-to-all


@dataclass(frozen=True)
class Collective:
    """One collective instruction of the compiled HLO."""

    kind: CollectiveKind
    in_bytes: int  # per device, one execution
    out_bytes: int  # per device, one execution
    group_size: int
    trip_count: int  # executions per program run
    computation: str
    text: str  # the instruction line, for reports
    trip_count_known: bool = True  # False when an enclosing loop has no known trip count
    # The groups of partition ids it runs within (cost_model.replica_groups); None: unknown.
    groups: Groups | None = None
    # How much wider XLA:CPU made the data than the program's values (:func:`widening`).
    widened: int = 1

    def at_program_dtype(self) -> Collective:
        """This collective moving the program's values, as a GPU or TPU runs it."""
        return dataclasses.replace(self, in_bytes=self.in_bytes // self.widened,
                                   out_bytes=self.out_bytes // self.widened, widened=1)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per program run, per the module's ring-algorithm table."""
        return wire_bytes(self.kind, self.in_bytes, self.out_bytes, self.group_size) * self.trip_count


@dataclass(frozen=True)
class HloSummary:
    """What one compiled program communicates, computes and holds in memory, per device."""

    collectives: tuple[Collective, ...]
    flops: float  # per device, as XLA's cost analysis counts them: a loop body once
    bytes_accessed: float  # per device, from cost_analysis if present else 0
    peak_memory_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    loop_matmul_flops: float = 0.0  # per device: the matmuls of loop trips after the first

    @property
    def flops_all_trips(self) -> float:
        """Per-device flops with each loop body's matmuls counted once per trip (XLA's cost
        analysis counts a body once)."""
        return self.flops + self.loop_matmul_flops

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives)

    def by_kind(self) -> dict[CollectiveKind, tuple[int, float]]:
        """Kind -> (executions per program run, wire bytes), for kinds that occur."""
        totals: dict[CollectiveKind, tuple[int, float]] = {}
        for c in self.collectives:
            count, wire = totals.get(c.kind, (0, 0.0))
            totals[c.kind] = (count + c.trip_count, wire + c.wire_bytes)
        return totals


# Opcode (sync or async start) -> kind. ragged-all-to-all is priced as an all-to-all of its
# whole output buffer, an upper bound since the sizes sent are only known at run time.
_KINDS = {
    "all-reduce": CollectiveKind.ALL_REDUCE,
    "all-gather": CollectiveKind.ALL_GATHER,
    "reduce-scatter": CollectiveKind.REDUCE_SCATTER,
    "all-to-all": CollectiveKind.ALL_TO_ALL,
    "ragged-all-to-all": CollectiveKind.ALL_TO_ALL,
    "collective-permute": CollectiveKind.COLLECTIVE_PERMUTE,
}

_CALLED = re.compile(
    r"[\s,](?P<attr>body|condition|calls|to_apply|true_computation|false_computation"
    r"|branch_computations|called_computations)=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_NAME = re.compile(r"%?([\w.\-]+)")
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_REPLICA_COUNT = re.compile(r"^HloModule .*\breplica_count=(\d+)", re.MULTILINE)
_NUM_PARTITIONS = re.compile(r"^HloModule .*\bnum_partitions=(\d+)", re.MULTILINE)

def _output_type(opcode: str, result_type: str) -> str:
    """The output part of a collective's result (async starts also carry their inputs)."""
    if opcode.endswith("-start") and opcode != "all-reduce-start":
        elements = tuple_elements(result_type)
        if len(elements) >= 2:
            return elements[1]
    return result_type


def _calls(instruction: Instruction):
    """(callee, executions per execution of the caller, known) for each computation called."""
    if instruction.opcode in ("async-done", "async-update"):
        return  # they name the computation their async-start already runs
    trip = _KNOWN_TRIP_COUNT.search(instruction.line)
    trips = int(trip[1]) if trip else 1
    for called in _CALLED.finditer(instruction.line):
        for callee in _NAME.findall(called["value"]):
            if called["attr"] == "body":
                yield callee, trips, trip is not None
            elif called["attr"] == "condition":
                yield callee, trips + 1 if trip else 1, trip is not None
            else:
                yield callee, 1, True


def _trip_counter(module: Module) -> Callable[[str], tuple[int, bool]]:
    """computation -> (executions per program run, whether every loop count was known)."""
    callers: dict[str, list[tuple[str, int, bool]]] = {}
    for computation, instructions in module.computations.items():
        for instruction in instructions:
            for callee, times, known in _calls(instruction):
                callers.setdefault(callee, []).append((computation, times, known))

    @functools.cache
    def trip_count(computation: str) -> tuple[int, bool]:
        if computation not in callers:  # the entry computation
            return 1, True
        total, all_known = 0, True
        for caller, times, known in callers[computation]:
            caller_total, caller_known = trip_count(caller)
            total += caller_total * times
            all_known = all_known and known and caller_known
        return total, all_known

    return trip_count


def loop_matmul_flops(module: Module) -> float:
    """Matmul flops of ``module`` that a count of each instruction once leaves out: those of a
    loop body's trips after the first (through nested loops; a loop of unknown trip count runs
    once). A conditional runs one branch, counted as its costliest."""
    seen: dict[tuple[str, bool], float] = {}

    def flops(computation: str, all_trips: bool) -> float:
        if (computation, all_trips) not in seen:
            seen[computation, all_trips] = sum(
                instruction_flops(computation, i, all_trips)
                for i in module.computations.get(computation, ()))
        return seen[computation, all_trips]

    def instruction_flops(computation: str, instruction: Instruction, all_trips: bool) -> float:
        if instruction.opcode == "while":
            trips = _KNOWN_TRIP_COUNT.search(instruction.attributes)
            times = int(trips[1]) if trips and all_trips else 1
            return times * sum(flops(b, all_trips) for b in instruction.called("body"))
        if instruction.opcode == "conditional":
            branches = (instruction.called("branch_computations")
                        or instruction.called("true_computation")
                        + instruction.called("false_computation"))
            return max((flops(b, all_trips) for b in branches), default=0.0)
        return sum(m.flops for m in matmuls(module, computation, instruction))

    return flops(module.entry, True) - flops(module.entry, False)


#: Ops that move or relabel a value without changing it, looked through to a convert.
_PASS_THROUGH = frozenset({"bitcast", "copy", "reshape", "transpose"})
_FLOAT16 = frozenset({"bf16", "f16"})


def widening(module: Module, computation: str, instruction: Instruction) -> int:
    """2 where XLA:CPU runs a collective of 16-bit floats in float32, else 1. It clones an
    all-reduce's reducer as ``*.clone_promoted``; for the other kinds it converts the operand
    up first (a ``convert``, or a fusion whose result is one, of a bf16 or f16 value)."""
    result = array_dims(_output_type(instruction.opcode, instruction.result_type) or "")
    if result is None or result[0] != "f32":
        return 1
    if any(name.endswith(".clone_promoted") for name in instruction.called("to_apply")):
        return 2
    names = {i.name: i for i in module.computations.get(computation, ())}
    operand = names.get(instruction.operands[0]) if instruction.operands else None
    if operand is not None and operand.opcode == "fusion":
        called = operand.called("calls")
        inside = module.computations.get(called[0], ()) if called else ()
        names = {i.name: i for i in inside}
        computation = called[0] if called else computation
        operand = next((i for i in inside if i.root), None)
    while operand is not None and operand.opcode in _PASS_THROUGH and operand.operands:
        operand = names.get(operand.operands[0])
    if operand is None or operand.opcode != "convert" or not operand.operands:
        return 1
    source = array_dims(module.type_of(computation, operand.operands[0]) or "")
    return 2 if source is not None and source[0] in _FLOAT16 else 1


#: Ops that pass a collective's value on unchanged, looked through to the kernel reading it.
_FORWARDING = frozenset({"all-reduce-done", "get-tuple-element", "bitcast"})
#: Ops of a kernel that only change its value's float width (XLA:CPU's 16-bit round trips).
_WIDTH_ONLY = frozenset({"parameter", "convert", "bitcast", "reshape"})
_PARTITION = frozenset({"partition-id", "replica-id"})
#: How many scalar ops deep a slice's offset is looked through for the partition id.
_OFFSET_DEPTH = 8


def width_only(module: Module, instruction: Instruction) -> bool:
    """Whether a kernel only changes its value's float width: a convert, or a fusion of
    converts and reshapes that move no data."""
    if instruction.opcode == "convert":
        return True
    called = instruction.called("calls") if instruction.opcode == "fusion" else ()
    inside = module.computations.get(called[0], ()) if called else ()
    return bool(inside) and all(i.opcode in _WIDTH_ONLY for i in inside)


def users_of(instructions) -> dict[str, list[Instruction]]:
    """Instruction name -> the instructions of the same computation that read it."""
    users: dict[str, list[Instruction]] = {}
    for i in instructions:
        for name in i.operands:
            users.setdefault(name, []).append(i)
    return users


def _readers(module: Module, users: dict, name: str) -> list[Instruction]:
    """The kernels that read value ``name``, through the ops that forward it and the kernels
    that only change its float width."""
    found = []
    for user in users.get(name, ()):
        through = user.opcode in _FORWARDING or width_only(module, user)
        found += _readers(module, users, user.name) if through else [user]
    return found


def _sliced_per_partition(module: Module, by_name: dict, reader: Instruction) -> bool:
    """Whether ``reader`` is a dynamic-slice (or a fusion holding one) whose offsets come
    from the device's partition or replica id."""
    fused = reader.called("calls") if reader.opcode == "fusion" else ()
    inside = module.computations.get(fused[0], ()) if fused else ()
    if reader.opcode != "dynamic-slice" and not any(
            i.opcode == "dynamic-slice" for i in inside):
        return False
    if any(i.opcode in _PARTITION for i in inside):
        return True
    seen, frontier = set(), list(reader.operands)
    for _ in range(_OFFSET_DEPTH):
        step = []
        for name in frontier:
            producer = by_name.get(name)
            if producer is None or name in seen or elements(producer.result_type) != 1:
                continue
            if producer.opcode in _PARTITION:
                return True
            seen.add(name)
            step += producer.operands
        frontier = step
    return False


def native_reduce_scatters(module: Module, collectives: tuple[Collective, ...]
                           ) -> tuple[Collective, ...]:
    """``collectives`` with each all-reduce that stands for a reduce-scatter read as one.

    XLA:CPU does not form reduce-scatters from what GSPMD partitions (XLA:GPU and TPU run a
    reduce-scatter creator pass): it all-reduces the whole buffer, and each device slices
    its part out by partition id. An all-reduce whose every reader (through converts of its
    float width) is such a slice of ``1/n`` of it, for its group of ``n``, becomes the
    reduce-scatter a GPU or TPU runs.
    """
    by_text = {c.text: c for c in collectives}
    native = {}
    for computation, instructions in module.computations.items():
        by_name, users = {i.name: i for i in instructions}, users_of(instructions)
        for i in instructions:
            c = by_text.get(i.line)
            if c is None or c.kind is not CollectiveKind.ALL_REDUCE or c.group_size < 2:
                continue
            total = elements(_output_type(i.opcode, i.result_type))
            readers = _readers(module, users, i.name)
            if readers and all(
                    elements(r.result_type) * c.group_size == total
                    and _sliced_per_partition(module, by_name, r)
                    for r in readers):
                native[c.text] = dataclasses.replace(
                    c, kind=CollectiveKind.REDUCE_SCATTER, out_bytes=c.in_bytes // c.group_size)
    return tuple(native.get(c.text, c) for c in collectives)


def _collective(module: Module, instruction: Instruction, computation: str, trip_count,
                num_devices: int) -> Collective | None:
    kind = _KINDS.get(instruction.opcode.removesuffix("-start"))
    if kind is None:
        return None
    n = group_size(instruction.line, num_devices)
    out_bytes = shape_bytes(_output_type(instruction.opcode, instruction.result_type))
    in_bytes = {
        CollectiveKind.ALL_GATHER: out_bytes // n,
        CollectiveKind.REDUCE_SCATTER: out_bytes * n,
    }.get(kind, out_bytes)
    trips, known = trip_count(computation)
    return Collective(
        kind=kind, in_bytes=in_bytes, out_bytes=out_bytes, group_size=n, trip_count=trips,
        computation=computation, text=instruction.line, trip_count_known=known,
        groups=device_groups(instruction.line, num_devices),
        widened=widening(module, computation, instruction))


def parse_collectives(hlo_text: str, num_devices: int) -> tuple[Collective, ...]:
    """Every collective in HLO text; ``num_devices`` sizes ``replica_groups={}``."""
    return _module_collectives(parse_module(hlo_text), num_devices)


def _module_collectives(module: Module, num_devices: int) -> tuple[Collective, ...]:
    trip_count = _trip_counter(module)
    collectives = []
    for computation, instructions in module.computations.items():
        for instruction in instructions:
            if collective := _collective(module, instruction, computation, trip_count,
                                         num_devices):
                collectives.append(collective)
    return tuple(collectives)


def num_devices(hlo_text: str) -> int:
    """Devices the module runs on: replica_count × num_partitions from its header."""
    replicas = _REPLICA_COUNT.search(hlo_text)
    partitions = _NUM_PARTITIONS.search(hlo_text)
    return (int(replicas[1]) if replicas else 1) * (int(partitions[1]) if partitions else 1)


def _per_device_costs(cost_analysis) -> dict:
    """cost_analysis() is a dict in jax 0.10, a list of per-device dicts before, or None."""
    if isinstance(cost_analysis, (list, tuple)):
        return cost_analysis[0] if cost_analysis else {}
    return cost_analysis or {}


def _platform(compiled) -> str:
    """The platform a compiled program runs on ("cpu", "gpu", "tpu"), "" if unknown."""
    for shardings in (getattr(compiled, "input_shardings", ()),
                      getattr(compiled, "output_shardings", ())):
        for s in _tree_leaves(shardings):
            devices = getattr(s, "device_set", None)
            if devices:
                return next(iter(devices)).platform
    return ""


def _tree_leaves(tree) -> list:
    import jax
    return jax.tree_util.tree_leaves(tree)


def compiled_peak_bytes(memory, platform: str) -> int:
    """Per-device peak memory of a compiled program.

    XLA:CPU's ``peak_memory_in_bytes`` is only arguments plus outputs: it leaves out the temp
    arena (checked on jax 0.10.2: a program with 8 MiB of temps reports the 4 MiB argument
    plus a 4-byte output), while the executable holds arguments, outputs and the whole temp
    arena for the run. On CPU the peak is therefore arguments + outputs - aliased + temps.
    GPU and TPU report a heap-simulated peak that includes temps; it is taken as is.
    """
    if memory is None:
        return 0
    if platform == "cpu":
        return int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                   - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    return int(getattr(memory, "peak_memory_in_bytes", 0))


def program_peak_bytes(compiled) -> int:
    """A ``jax.stages.Compiled`` program's per-device peak (:func:`compiled_peak_bytes`)."""
    return compiled_peak_bytes(compiled.memory_analysis(), _platform(compiled))


def analyze(compiled) -> HloSummary:
    """Collectives, per-device flops and memory of a ``jax.stages.Compiled``."""
    hlo_text = compiled.as_text()
    module = parse_module(hlo_text)
    costs = _per_device_costs(compiled.cost_analysis())
    memory = compiled.memory_analysis()  # None where the backend reports none: sizes read 0
    return HloSummary(
        collectives=_module_collectives(module, num_devices(hlo_text)),
        flops=float(costs.get("flops", 0.0)),
        bytes_accessed=float(costs.get("bytes accessed", 0.0)),
        peak_memory_bytes=compiled_peak_bytes(memory, _platform(compiled)),
        argument_bytes=int(getattr(memory, "argument_size_in_bytes", 0)),
        output_bytes=int(getattr(memory, "output_size_in_bytes", 0)),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
        alias_bytes=int(getattr(memory, "alias_size_in_bytes", 0)),
        loop_matmul_flops=loop_matmul_flops(module),
    )


def permute_loops(hlo_text: str) -> list[int]:
    """Trip counts of the ``while`` loops whose body runs a collective-permute (in the body
    itself or in a conditional branch it calls, not in a nested loop): a pipeline's tick
    loops. A loop without a known trip count reads 0."""
    module = parse_module(hlo_text)

    def permutes(name: str, seen: set) -> bool:
        seen.add(name)
        for instruction in module.computations.get(name, ()):
            if instruction.opcode.startswith("collective-permute"):
                return True
            if instruction.opcode == "conditional" and any(
                    permutes(b, seen) for b in instruction.called("branch_computations")
                    if b not in seen):
                return True
        return False

    found = []
    for instructions in module.computations.values():
        for instruction in instructions:
            if instruction.opcode != "while":
                continue
            body = instruction.called("body")
            if body and permutes(body[0], set()):
                trips = _KNOWN_TRIP_COUNT.search(instruction.attributes)
                found.append(int(trips.group(1)) if trips else 0)
    return sorted(found)
