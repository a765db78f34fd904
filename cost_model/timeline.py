"""A simulated timeline of one device's step, from the compiled HLO text of a program.

:func:`simulate` walks the entry computation in program order (the printed schedule), into
the computations it calls: a ``while`` runs its condition and body ``known_trip_count`` times
(1 when unknown, marked in ``trip_counts_known``), a ``call`` runs its callee, a
``conditional`` its slowest branch. One device has

* a compute stream: every kernel runs on it, one at a time, in program order, for its
  roofline time (``cost_model.hlo_roofline.kernel_time_s``), once the compute stream is free
  and its operands are ready;
* one communication stream per interconnect level: a collective runs on the stream of the
  level its groups cross (``cost_model.reference.collective_level``) for its alpha-beta time
  (``cost_model.reference.collective_time_s``), once that stream is free and its operands
  are ready. A synchronous collective (and an async pair XLA marks ``"is_sync":true``) also
  holds the compute stream until it ends. An async ``*-start`` is issued when the compute
  stream reaches it and does not hold it: compute goes on until the matching ``*-done``,
  which waits for the collective to end.

Bookkeeping ops (parameters, tuples, bitcasts, ...) take no time and pass readiness on.
Step time is when the last stream finishes; the time the compute stream is not busy is
time spent waiting for communication, reported as ``exposed_comm_s``. A loop of more than
``FULL_TRIPS`` trips is simulated for ``FULL_TRIPS`` trips; each further trip is taken to
repeat the last one (every stream and loop value shifts by what that trip added), and its
events are not listed. Not modeled: a collective slowing the kernels it overlaps (shared
memory bandwidth and SMs), and kernels running side by side on several compute streams.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from autopar.cost_model.hardware import LevelKind
from autopar.cost_model.hlo import (
    Collective,
    native_reduce_scatters,
    num_devices,
    parse_collectives,
    users_of,
    width_only,
)
from autopar.cost_model.hlo_async import as_async
from autopar.cost_model.hlo_ir import Instruction, Module, parse_module
from autopar.cost_model.hlo_roofline import FREE_OPCODES, kernel_time_s
from autopar.cost_model.reference import collective_level, collective_time_s

FULL_TRIPS = 4
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INDEX = re.compile(r"(?:^|[\s,])index=(\d+)")
_IS_SYNC = re.compile(r'"is_sync":true')

# When a value is ready: a time in seconds, or one per element of a tuple.
Ready = Union[float, tuple["Ready", ...]]


@dataclass(frozen=True)
class Event:
    """One op on one stream; ``level`` None is the compute stream."""

    name: str
    level: LevelKind | None
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """One device's simulated step (see the module docstring)."""

    step_time_s: float
    compute_busy_s: float  # kernels' time on the compute stream
    exposed_comm_s: float  # step time the compute stream spends waiting for communication
    comm_busy_s: dict[LevelKind, float]  # per level, time its stream carries collectives
    events: tuple[Event, ...]
    trip_counts_known: bool


@dataclass
class _Clock:
    compute_s: float = 0.0  # when the compute stream is next free
    busy_s: float = 0.0
    streams_s: dict[LevelKind, float] = field(default_factory=dict)  # next free, per level
    stream_busy_s: dict[LevelKind, float] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    known: bool = True

    def fork(self) -> _Clock:
        """A copy of the clock's times, with no events yet."""
        return dataclasses.replace(self, streams_s=dict(self.streams_s),
                                   stream_busy_s=dict(self.stream_busy_s), events=[])


def _latest(ready: Ready) -> float:
    if isinstance(ready, tuple):
        return max((_latest(r) for r in ready), default=0.0)
    return ready


def _shift(ready: Ready, by_s: float) -> Ready:
    if isinstance(ready, tuple):
        return tuple(_shift(r, by_s) for r in ready)
    return ready + by_s


def width_kernels(module: Module, collectives: Sequence[Collective]
                  ) -> frozenset[tuple[str, str]]:
    """(computation, name) of the kernels that only convert a widened collective's operand up
    to float32 (read by nothing else) or its result back down: XLA:CPU's, for collectives it
    carries 16-bit floats in as float32 (``cost_model.hlo.widening``)."""
    widened = {c.text for c in collectives if c.widened > 1}
    found = set()
    for computation, instructions in module.computations.items():
        by_name, users = {i.name: i for i in instructions}, users_of(instructions)

        def is_widened(i: Instruction) -> bool:
            if i.opcode == "async-start":
                wrapped = module.computations.get(i.called("calls")[0], ())
                return any(x.line in widened for x in wrapped)
            return i.line in widened

        def results(i: Instruction) -> list[Instruction]:
            """The readers of ``i``'s value, through its ``*-done`` and free ops."""
            out = []
            for user in users.get(i.name, ()):
                through = user.opcode.endswith("-done") or user.opcode in (
                    "get-tuple-element", "bitcast")
                out += results(user) if through else [user]
            return out

        for i in instructions:
            if not is_widened(i):
                continue
            for name in i.operands:
                operand = by_name.get(name)
                if (operand is not None and width_only(module, operand)
                        and all(is_widened(u) for u in users.get(name, ()))):
                    found.add((computation, name))
            found.update((computation, u.name) for u in results(i) if width_only(module, u))
    return frozenset(found)


class _Simulator:
    def __init__(self, module: Module, profile, dtype, collectives: Sequence[Collective],
                 device_ids: Sequence[int] | None,
                 free: frozenset[tuple[str, str]] = frozenset()):
        self.module, self.profile, self.dtype, self.device_ids = (
            module, profile, dtype, device_ids)
        self.collectives = {c.text: c for c in collectives}
        self.free = free  # kernels that take no time (see width_kernels)
        self.clock = _Clock()
        self._kernel_s: dict[tuple[str, str], float] = {}

    def run(self, computation: str, args: Sequence[Ready]) -> Ready:
        """Run one computation on the clock; returns when its root's value is ready."""
        env: dict[str, Ready] = {}
        result: Ready = 0.0
        for instruction in self.module.computations.get(computation, ()):
            env[instruction.name] = self._step(computation, instruction, env, args)
            if instruction.root:
                result = env[instruction.name]
        return result

    def _operands(self, instruction: Instruction, env) -> list[Ready]:
        return [env.get(name, 0.0) for name in instruction.operands]

    def _step(self, computation: str, instruction: Instruction, env, args) -> Ready:
        op = instruction.opcode
        if op == "parameter":
            index = int(instruction.operands[0])
            return args[index] if index < len(args) else 0.0
        if op == "tuple":
            return tuple(self._operands(instruction, env))
        if op == "get-tuple-element":
            value = env.get(instruction.operands[0], 0.0)
            index = int(_INDEX.search(instruction.attributes)[1])
            return value[index] if isinstance(value, tuple) and index < len(value) else value
        if op in FREE_OPCODES or op == "async-update":
            return _latest(tuple(self._operands(instruction, env)))
        if op == "while":
            return self._while(instruction, env)
        if op == "call":
            return self.run(instruction.called("to_apply")[0], self._operands(instruction, env))
        if op == "conditional":
            return self._conditional(instruction, env)
        if op.endswith("-done"):
            return self._wait(_latest(tuple(self._operands(instruction, env))))
        if collective := self._collective(instruction):
            return self._communicate(instruction, collective, env)
        if op == "async-start":  # an async computation that is no collective: run it here
            return self.run(instruction.called("calls")[0], self._operands(instruction, env))
        return self._kernel(computation, instruction, env)

    def _collective(self, instruction: Instruction) -> Collective | None:
        if instruction.opcode == "async-start":
            wrapped = self.module.computations.get(instruction.called("calls")[0], ())
            return next((self.collectives[i.line] for i in wrapped if i.line in self.collectives),
                        None)
        return self.collectives.get(instruction.line)

    def _kernel(self, computation: str, instruction: Instruction, env) -> float:
        key = (computation, instruction.name)
        if key in self.free:
            return _latest(tuple(self._operands(instruction, env)))
        if key not in self._kernel_s:
            self._kernel_s[key] = kernel_time_s(self.module, computation, instruction,
                                                self.profile, self.dtype)
        clock = self.clock
        start = max(clock.compute_s, _latest(tuple(self._operands(instruction, env))))
        clock.compute_s = start + self._kernel_s[key]
        clock.busy_s += self._kernel_s[key]
        clock.events.append(Event(instruction.name, None, start, clock.compute_s))
        return clock.compute_s

    def _communicate(self, instruction: Instruction, collective: Collective, env) -> float:
        clock = self.clock
        level = collective_level(self.profile, collective, self.device_ids).kind
        duration = collective_time_s(self.profile, collective, self.device_ids)
        start = max(clock.compute_s, _latest(tuple(self._operands(instruction, env))),
                    clock.streams_s.get(level, 0.0))
        end = start + duration
        clock.streams_s[level] = end
        clock.stream_busy_s[level] = clock.stream_busy_s.get(level, 0.0) + duration
        clock.events.append(Event(instruction.name, level, start, end))
        sync = _IS_SYNC.search(instruction.attributes) or _IS_SYNC.search(collective.text)
        asynchronous = instruction.opcode.endswith("-start") and not sync
        if not asynchronous:
            clock.compute_s = end
        return end

    def _wait(self, ready_s: float) -> float:
        self.clock.compute_s = max(self.clock.compute_s, ready_s)
        return self.clock.compute_s

    def _while(self, instruction: Instruction, env) -> Ready:
        body, condition = instruction.called("body")[0], instruction.called("condition")[0]
        trips = _KNOWN_TRIP_COUNT.search(instruction.attributes)
        self.clock.known = self.clock.known and trips is not None
        trips = int(trips[1]) if trips else 1
        carry = env.get(instruction.operands[0], 0.0)
        before = self.clock
        for _ in range(min(trips, FULL_TRIPS)):
            before = self.clock.fork()
            self.run(condition, [carry])
            carry = self.run(body, [carry])
        if trips > FULL_TRIPS:
            carry = self._repeat_last_trip(before, carry, trips - FULL_TRIPS)
        self.run(condition, [carry])
        return carry

    def _repeat_last_trip(self, before: _Clock, carry: Ready, times: int) -> Ready:
        clock = self.clock
        period_s = clock.compute_s - before.compute_s
        clock.compute_s += times * period_s
        clock.busy_s += times * (clock.busy_s - before.busy_s)
        for level, free_s in list(clock.streams_s.items()):
            clock.streams_s[level] = free_s + times * (free_s - before.streams_s.get(level, 0.0))
            busy_s = clock.stream_busy_s[level]
            clock.stream_busy_s[level] += times * (busy_s - before.stream_busy_s.get(level, 0.0))
        return _shift(carry, times * period_s)

    def _conditional(self, instruction: Instruction, env) -> Ready:
        branches = (instruction.called("branch_computations")
                    or instruction.called("true_computation")
                    + instruction.called("false_computation"))
        operands = self._operands(instruction, env)
        start, finished = self.clock, []
        for index, branch in enumerate(branches):
            self.clock = start.fork()
            value = self.run(branch, operands[index + 1: index + 2])
            finished.append((self.clock, value))
        self.clock = start
        if not finished:
            return 0.0
        slowest, value = max(finished, key=lambda f: f[0].compute_s)
        self.clock = dataclasses.replace(slowest, events=start.events + slowest.events)
        return value


def simulate(hlo_text: str, profile, dtype=None, device_ids: Sequence[int] | None = None,
             scheduled: bool = False, program_dtypes: bool = False) -> Timeline:
    """One device's step of the compiled program ``hlo_text`` on ``profile``.

    ``dtype`` (a jnp dtype or profile dtype name) prices every matmul at that rate (None: at
    its operands' type); ``device_ids`` maps partition ids to device ids for the levels
    (``cost_model.reference``). ``scheduled``: read every synchronous collective as an
    asynchronous one issued when its operands are ready and awaited at its first use
    (``cost_model.hlo_async``), as a GPU or TPU would run a program XLA:CPU compiled.
    ``program_dtypes``: read the collectives as a GPU or TPU compiles them. Each XLA:CPU
    widened (16-bit floats carried as float32, ``cost_model.hlo.widening``) moves the
    program's own dtype, and the kernels that only convert its operand up or its result
    back down (:func:`width_kernels`) are not run; an all-reduce each device only slices its
    part of is the reduce-scatter XLA:CPU emulates with it
    (``cost_model.hlo.native_reduce_scatters``).
    """
    if scheduled:
        hlo_text = as_async(hlo_text)
    module = parse_module(hlo_text)
    collectives = parse_collectives(hlo_text, num_devices(hlo_text))
    free: frozenset[tuple[str, str]] = frozenset()
    if program_dtypes:
        free = width_kernels(module, collectives)
        collectives = tuple(c.at_program_dtype()
                            for c in native_reduce_scatters(module, collectives))
    simulator = _Simulator(module, profile, dtype, collectives, device_ids, free)
    entry = module.computations.get(module.entry, ())
    params = sum(1 for i in entry if i.opcode == "parameter")
    result = simulator.run(module.entry, [0.0] * params)
    clock = simulator.clock
    step_s = max([clock.compute_s, _latest(result), *clock.streams_s.values()])
    return Timeline(step_time_s=step_s, compute_busy_s=clock.busy_s,
                    exposed_comm_s=step_s - clock.busy_s, comm_busy_s=dict(clock.stream_busy_s),
                    events=tuple(clock.events), trip_counts_known=clock.known)


def simulate_compiled(compiled, profile, dtype=None,
                      device_ids: Sequence[int] | None = None,
                      scheduled: bool = False, program_dtypes: bool = False) -> Timeline:
    """:func:`simulate` of a ``jax.stages.Compiled``."""
    return simulate(compiled.as_text(), profile, dtype, device_ids, scheduled, program_dtypes)
