"""The Plan: what autopar decided, its prediction, and the program that runs it."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from autopar._mesh import (axis_sizes, check_axis_name, mesh_text, on_explicit_axes,
                           simulate_hint)
from autopar._explained import explanation, explanation_from_json, explanation_to_json
from autopar._layers import flat_donation, has_layers, memory_over_program
from autopar._export import plain_jit_check, write_module
from autopar._html import render_html
from autopar._sizes import format_bytes, format_seconds
from autopar._summary import summary_lines
from autopar.errors import ArgumentError, HardwareWarning, MeshError, PlanFormatError, warn
from autopar.passes.estimate import Estimate
from autopar.passes.ir import canonical_dtype

FORMAT_VERSION = 1


#: ``stats`` keys that hold wall-clock measurements: kept on the Plan, not in its JSON, so
#: that the same plan saves to the same bytes.
WALL_CLOCK_STATS = ("timings_s",)


def _spec_to_json(pspec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in pspec]


def _bad(what: str, value) -> PlanFormatError:
    shown = repr(value)
    return PlanFormatError(f"`{what}` is {shown[:80] + ' ...' if len(shown) > 80 else shown}, "
                           "which a plan written by plan.save(path) never holds; save the plan "
                           "again")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _pipeline_from_json(record) -> dict | None:
    if record is None:
        return None
    ranges = record.get("layer_ranges", ()) if isinstance(record, dict) else None
    if not isinstance(ranges, (list, tuple)) or not all(
            isinstance(r, list) and len(r) == 2 and all(map(_is_int, r)) for r in ranges):
        raise _bad("pipeline", record)
    return {**record, "layer_ranges": [tuple(r) for r in ranges]}


def _spec_from_json(entries, axes: tuple, what: str) -> PartitionSpec:
    """A saved spec: a list whose entries are None, an axis of ``axes``, or a list of them,
    each axis at most once."""
    if not isinstance(entries, list):
        raise PlanFormatError(f"`{what}` is {entries!r}: a spec must be a list of mesh axis "
                              "entries (None, an axis name, or a list of names); save the plan "
                              "again")
    used = []
    for e in entries:
        names = e if isinstance(e, list) else [e]
        if e is not None and not all(isinstance(n, str) and n in axes for n in names):
            raise PlanFormatError(f"`{what}` entry {e!r} names no axis of the plan's mesh "
                                  f"{list(axes)}; save the plan again")
        used += [] if e is None else names
    if len(set(used)) != len(used):
        raise PlanFormatError(f"`{what}` {entries!r} uses a mesh axis twice; save the plan again")
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


def _mesh_from_json(record) -> Mesh | AbstractMesh:
    """The saved mesh: the same devices (by id) when the file names them, so a plan made on
    some of the devices (a sub-mesh) loads back onto them; else the first devices. Where those
    devices are not in this process, the mesh's axes without devices (an AbstractMesh), with
    a HardwareWarning: the plan can be read here, not run."""
    if not isinstance(record, dict):
        raise _bad("mesh", record)
    names, sizes = record.get("axis_names"), record.get("axis_sizes")
    if (not isinstance(names, list) or not isinstance(sizes, list) or len(names) != len(sizes)
            or not names or not all(_is_int(n) and n > 0 for n in sizes)):
        raise _bad("mesh", record)
    for name in names:
        check_axis_name(name)
    ids = record.get("device_ids")
    if ids is not None and (not isinstance(ids, list) or not all(map(_is_int, ids))
                            or len(set(ids)) != len(ids)):
        raise _bad("mesh.device_ids", ids)
    if ids is not None and len(ids) != math.prod(sizes):
        raise PlanFormatError(
            f"the plan's mesh {dict(zip(names, sizes))} has {math.prod(sizes)} devices but "
            f"names {len(ids)} device ids; a plan written by plan.save(path) never holds both; "
            "save the plan again")
    need, here = math.prod(sizes), jax.devices()
    devices = {d.id: d for d in here}
    missing = ([i for i in ids if i not in devices] if ids is not None
               else [] if need <= len(here) else [None])
    if missing:
        absent = (f"{len(missing)} of which ({_ids(missing)}) are not in this process "
                  f"({_devices(len(here))} here)" if ids is not None
                  else f"and this process has {_devices(len(here))}")
        warn(f"autopar: the plan's mesh {dict(zip(names, sizes))} runs on {need} devices, "
             f"{absent}: it is loaded on its axes without devices (a jax AbstractMesh), to "
             f"read (report, summary, to_python), not to run. {simulate_hint(need)}",
             HardwareWarning)
        return AbstractMesh(tuple(sizes), tuple(names), axis_types=(AxisType.Auto,) * len(names))
    chosen = [devices[i] for i in ids] if ids is not None else here[:need]
    return Mesh(np.array(chosen, dtype=object).reshape(sizes), tuple(names),
                axis_types=(AxisType.Auto,) * len(names))


def _devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def _ids(ids: list[int], shown: int = 8) -> str:
    """``ids`` as ``ids 1, 2, 3`` or, past ``shown`` of them, ``ids 1, 2, ... 9 (12 in all)``."""
    if len(ids) <= shown:
        return "ids " + ", ".join(map(str, ids))
    return f"ids {', '.join(map(str, ids[:shown - 1]))}, ... {ids[-1]} ({len(ids)} in all)"


def _shardings_from_json(records, mesh: Mesh, what: str) -> tuple[list, list[str]]:
    if not isinstance(records, list) or not all(
            isinstance(r, dict) and isinstance(r.get("path"), str) for r in records):
        raise _bad(what, records)
    axes = tuple(mesh.axis_names)
    specs = [_spec_from_json(r.get("spec"), axes, f"{what}[{i}].spec")
             for i, r in enumerate(records)]
    return [NamedSharding(mesh, s) for s in specs], [r["path"] for r in records]


def _estimate_from_json(record) -> Estimate:
    names = [f.name for f in dataclasses.fields(Estimate)]
    if (not isinstance(record, dict) or sorted(record) != sorted(names)
            or not all(_is_number(v) for v in record.values())):
        raise _bad("estimate", record)
    return Estimate(**record)


def _plan_from_dict(cls, d: dict) -> Plan:
    """:meth:`Plan.from_json`'s plan, every field checked."""
    if "in_shardings" not in d:
        looks = (" (it looks like a hardware profile: "
                 "pass its path as `hardware=` to autopar.plan)" if "peak_flops_per_s" in d else "")
        raise PlanFormatError(f"this is not a saved plan: it has no `in_shardings`{looks}; "
                              "give a file written by Plan.save")
    if d.get("format_version") != FORMAT_VERSION:
        raise PlanFormatError(f"plan format version {d.get('format_version')!r} is not "
                              f"{FORMAT_VERSION}: re-plan and save again")
    mesh = _mesh_from_json(d.get("mesh"))
    ins, in_paths = _shardings_from_json(d.get("in_shardings"), mesh, "in_shardings")
    outs, out_paths = _shardings_from_json(d.get("out_shardings"), mesh, "out_shardings")
    hardware, fallbacks = d.get("hardware"), d.get("fallbacks", {})
    stats, donate = d.get("stats", {}), d.get("donate_argnums", [])
    if not isinstance(hardware, str):
        raise _bad("hardware", hardware)
    if not isinstance(fallbacks, dict) or not all(map(_is_int, fallbacks.values())):
        raise _bad("fallbacks", fallbacks)
    if not isinstance(stats, dict):
        raise _bad("stats", stats)
    if not isinstance(donate, list) or not all(_is_int(i) and i >= 0 for i in donate):
        raise _bad("donate_argnums", donate)
    ids = d["mesh"].get("device_ids")
    explained = (None if "explained" not in d else
                 explanation_from_json(d["explained"], in_paths, [s.spec for s in ins],
                                       axis_sizes(mesh)))
    return cls(mesh, ins, outs, _estimate_from_json(d.get("estimate")), hardware, in_paths,
               out_paths, fallbacks, stats, donate_argnums=tuple(donate),
               pipeline=_pipeline_from_json(d.get("pipeline")),
               _device_ids=tuple(ids) if isinstance(mesh, AbstractMesh) and ids else None,
               _explained=explained)


@dataclass
class Plan:
    """A sharding plan for one function, mesh and input signature.

    Attributes:
      mesh: the jax Mesh (Auto axes) the plan runs on (an AbstractMesh in a plan loaded
        where its devices are not, see :meth:`load`).
      in_shardings / out_shardings: pytrees of NamedSharding shaped like the arguments /
        results. A plan read back with :meth:`load` or :meth:`from_json` holds them flat, one
        per leaf in ``jax.tree.leaves`` order (the JSON keeps no pytree classes):
        ``jax.tree.unflatten(jax.tree.structure(args), plan.in_shardings)`` rebuilds the tree.
      estimate: per-device predictions (:class:`autopar.passes.estimate.Estimate`).
      hardware: the name of the hardware profile the costs came from.
      donate_argnums: the arguments whose buffers the program reuses for its results (set by
        ``parallelize(donate_argnums=...)`` or :meth:`with_donation`); the peak memory
        estimate counts them.
      compiler_options: XLA options :meth:`jit` compiles the program with: those the program
        needs (on XLA:CPU, a rematerialized plan keeps its optimization barriers), and those
        that let the hardware profile's backend overlap communication (asynchronous
        collectives and latency-hiding scheduling on GPU, collective fusion and windowed
        einsum on TPU; ``passes.backend_options``), each set only when the program compiles
        for that backend and its compiler takes it. ``stats["compiler_options"]`` and the
        report list every option considered: set and why, or skipped and why not.
      pipeline: None when the plan does not pipeline; else what it runs: ``axis``,
        ``stages``, ``layer_ranges`` ([first, last) layer per stage), ``microbatches``,
        ``schedule``, ``virtual_stages``, ``ticks`` and the predicted ``bubble_fraction``.
      stats: planner statistics; ``stats["remat"]`` names the rematerialized layers and the
        policy when the plan needed rematerialization to fit its memory budget, else None;
        ``stats["source"]`` says where the plan came from ("ilp", "propagated" or "cached"),
        and ``stats["solver_status"]`` names it (the solver's status, or the candidate's name).
    """
    mesh: Any
    in_shardings: Any
    out_shardings: Any
    estimate: Estimate
    hardware: str
    in_paths: list[str] = field(default_factory=list)
    out_paths: list[str] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    _flat_fn: Callable | None = None
    _in_tree: Any = None
    _out_tree: Any = None
    _arg_avals: tuple = ()
    _details: Any = None   # (graph, strategies, choice, comms) for the report
    donate_argnums: tuple[int, ...] = ()
    compiler_options: dict = field(default_factory=dict)  # XLA options the program needs
    pipeline: dict | None = None
    # the saved device ids of a plan loaded where they do not exist (its mesh an AbstractMesh)
    _device_ids: tuple[int, ...] | None = None
    # (fn, the HloSummary of fn under plain jax.jit with this plan's in/out shardings): what
    # exportable planning compiled to choose them, for to_python's check
    _plain_summary: Any = field(default=None, compare=False, repr=False)
    # a loaded plan's explanation (_explained.Explained): what its saved report said
    _explained: Any = field(default=None, compare=False, repr=False)

    # ----- running
    def _require_program(self, method: str):
        if self._flat_fn is None:
            raise PlanFormatError(
                f"plan.{method}() needs the planned program, and this plan was loaded from JSON: "
                "it holds the shardings (flat, one per argument leaf, in plan.in_paths), the "
                "estimates and the report, not the program. Plan again with autopar.plan(fn, "
                "*args, mesh=...), or write plan.to_python(path) and run fn with jax.jit(fn, "
                "in_shardings=module.in_shardings(mesh, like=args), out_shardings="
                "module.out_shardings(mesh, like=jax.eval_shape(fn, *args))).")

    def jit(self, donate_argnums=None) -> Callable:
        """A callable with the planned function's signature that runs the parallel program.

        ``donate_argnums`` (as in ``jax.jit``) defaults to the plan's own. Arguments committed
        to other devices or shardings (another program's results) are copied into the
        planned shardings first; ``jax.jit`` itself would refuse them."""
        self._require_program("jit")
        if donate_argnums is None:
            donate_argnums = self.donate_argnums
        flat_in = jax.tree_util.tree_leaves(self.in_shardings)
        flat_out = jax.tree_util.tree_leaves(self.out_shardings)
        donate = flat_donation(self._in_tree, donate_argnums)
        jitted = jax.jit(self._guarded_flat_fn(), in_shardings=flat_in, out_shardings=flat_out,
                         donate_argnums=donate, compiler_options=self.compiler_options or None)
        in_tree, out_tree, mesh = self._in_tree, self._out_tree, self.mesh

        def call(method, args):
            leaves, tree = jax.tree_util.tree_flatten(args)
            if tree != in_tree:
                raise ArgumentError(_tree_difference(self.in_paths, args))
            leaves = [_placed(x, s) for x, s in zip(leaves, flat_in)]
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # Auto axes, as planned
                return method(*leaves)

        def run(*args):
            return jax.tree_util.tree_unflatten(out_tree, call(jitted, args))
        run.lower = lambda *args: call(jitted.lower, args)
        return run

    def _guarded_flat_fn(self) -> Callable:
        """The program's flat function, first checking (when jax traces it, so never on a
        call of the shapes planned) that each leaf has its planned shape and dtype: else a
        ArgumentError naming the leaf, rather than an error from deep in the program."""
        flat_fn, paths = self._flat_fn, self.in_paths
        planned = [(tuple(a.shape), canonical_dtype(a.dtype)) for a in self._arg_avals]

        @functools.wraps(flat_fn)  # the program's ops keep the step's name
        def guarded(*leaves):
            for i, (x, want) in enumerate(zip(leaves, planned)):
                got = (tuple(x.shape), canonical_dtype(x.dtype))
                if got != want:
                    where = paths[i] if i < len(paths) else f"leaf {i}"
                    raise ArgumentError(
                        f"argument {where} is {_typed(*got)}, but the plan was made for "
                        f"{_typed(*want)}: plan again for these arguments "
                        "(autopar.parallelize plans once per signature)")
            return flat_fn(*leaves)
        return guarded

    def with_donation(self, donate_argnums) -> Plan:
        """This plan, its program reusing the buffers of arguments ``donate_argnums`` for the
        results (params and optimizer state in a train step); the memory estimate follows."""
        self._require_program("with_donation")
        argnums = tuple(sorted({donate_argnums} if isinstance(donate_argnums, int)
                               else set(donate_argnums)))
        donating = dataclasses.replace(self, donate_argnums=argnums)
        held, live = memory_over_program(donating)
        donating.estimate = dataclasses.replace(self.estimate,
                                                peak_memory_bytes=held + max(live, default=0))
        return donating

    def compile(self):
        """The jax.stages.Compiled program, compiled from abstract arguments (nothing runs)."""
        self._require_program("compile")
        flat_in = jax.tree_util.tree_leaves(self.in_shardings)
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                    for a, s in zip(self._arg_avals, flat_in)]
        return self.jit().lower(*jax.tree_util.tree_unflatten(self._in_tree, abstract)).compile()

    # ----- explaining
    def report(self, baselines: dict | None = None) -> str:
        """A human-readable account of the plan: the estimate, per-layer parameter shardings
        with time and memory, the collectives chosen and why, fallbacks, planner statistics.
        ``baselines``: {name: Plan} shown beside it, each a plan of the same function on the
        same mesh (the CLI's ``autopar report`` passes its data-parallel and FSDP baselines'
        plans here); None: the plan alone.
        """
        from autopar._report import render_text
        return render_text(self, baselines)

    def __repr__(self) -> str:
        """One line: the mesh, the hardware, the predicted step and peak, and where the plan
        came from (the graph and strategies it keeps for the report are left out)."""
        source = self.stats.get("source")
        return (f"Plan(mesh=({mesh_text(self.mesh)}), hardware={self.hardware!r}, step "
                f"{format_seconds(self.estimate.step_time_s)}, peak "
                f"{format_bytes(self.estimate.peak_memory_bytes)} per device"
                + (f", from {source}" if source else "")
                + (", pipelined" if self.pipeline else "") + "; plan.summary() says what it "
                "chose)")

    def summary(self) -> str:
        """The plan in words, one line per group of like layers, then the inputs and the
        optimizer state, e.g. ``block_0..block_11: Megatron TP over model(4), batch over
        data(2)``. It opens :meth:`report`."""
        return "\n".join(summary_lines(self))

    def to_html(self, baselines: dict | None = None) -> str:
        """The report as one self-contained HTML page (inline CSS and SVG, no external
        assets; its CSS applies only inside its ``autopar-report`` element)."""
        return render_html(self, baselines)

    def _repr_html_(self) -> str:
        """Notebooks show a plan as its report (the fragment, no page around it)."""
        return render_html(self, fragment=True)

    def to_python(self, path: str | os.PathLike, fn: Callable | None = None) -> str:
        """Write a standalone Python module for plain ``jax.jit`` to ``path``: ``MESH`` (axis
        name -> size), ``IN_SPECS`` and ``OUT_SPECS`` (PartitionSpec pytrees shaped like the
        arguments and results), ``LOGICAL_AXIS_RULES``, ``make_mesh()``,
        ``in_shardings(mesh)`` and ``out_shardings(mesh)``. Returns the text written.

        ``fn``: the planned function. When given, both programs are compiled (nothing runs;
        an exportable plan reuses the plain one its choice compiled) and the module says
        whether plain ``jax.jit`` with these shardings compiles to the plan's collectives: jax
        infers intermediate shardings from the arguments and results, so a plan that splits an
        intermediate otherwise is reproduced only by ``plan.jit()``.

        Example::

          plan.to_python("plan_specs.py")
          # elsewhere, without autopar:
          import plan_specs
          mesh = plan_specs.make_mesh()
          step = jax.jit(train_step, in_shardings=plan_specs.in_shardings(mesh),
                         out_shardings=plan_specs.out_shardings(mesh))
        """
        words = summary_lines(self) if has_layers(self) else None
        if self.pipeline and words is not None:
            words = ["Plain jax.jit runs no pipeline: these shardings keep the stacked layers",
                     f"split over {self.pipeline['axis']}, and XLA runs the step whole, with "
                     "no microbatches", "or schedule (plan.jit() runs the plan's pipeline). "
                     "The plan in words:"] + [f"  {line}" for line in words]
        verdict = plain_jit_check(self, fn)[1] if fn is not None and self._flat_fn else ""
        name = getattr(fn, "__name__", "")
        return write_module(self, path, name if name.isidentifier() else "step", words,
                            verdict=verdict)

    def validate(self) -> dict:
        """Compile the plan and put its prediction beside the compiled HLO: wire bytes, flops
        and peak memory as (predicted, compiled), per-kind collective counts and bytes, and the
        collective kinds XLA inserted that the plan did not predict."""
        self._require_program("validate")
        from autopar._validate import validate
        return validate(self)

    # ----- saving
    def to_json(self) -> str:
        """The plan as JSON: its mesh (axis names, sizes, device ids), shardings, estimate,
        statistics and what its report says of the traced program (``autopar._explained``),
        so that a loaded plan explains itself as this one does. Wall-clock measurements
        (:data:`WALL_CLOCK_STATS`) stay out, so the same plan always gives the same text."""
        def shardings(tree, paths):
            return [{"path": p, "spec": _spec_to_json(s.spec)}
                    for p, s in zip(paths, jax.tree_util.tree_leaves(tree))]
        explained = explanation(self)
        return json.dumps({
            "format_version": FORMAT_VERSION,
            "mesh": {"axis_names": list(self.mesh.axis_names),
                     "axis_sizes": list(axis_sizes(self.mesh).values()),
                     "device_ids": self._saved_device_ids()},
            "hardware": self.hardware,
            "estimate": self.estimate.to_dict(),
            "in_shardings": shardings(self.in_shardings, self.in_paths),
            "out_shardings": shardings(self.out_shardings, self.out_paths),
            "donate_argnums": list(self.donate_argnums),
            "fallbacks": self.fallbacks,
            "stats": {k: v for k, v in self.stats.items() if k not in WALL_CLOCK_STATS},
            "pipeline": self.pipeline,
            **({} if explained is None else {"explained": explanation_to_json(explained)}),
        }, indent=1, default=_json_default)

    def _saved_device_ids(self) -> list[int] | None:
        if isinstance(self.mesh, AbstractMesh):
            return None if self._device_ids is None else list(self._device_ids)
        return [int(d.id) for d in self.mesh.devices.flat]

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan read back from :meth:`to_json`: shardings and estimates, no program.
        PlanFormatError for any text :meth:`to_json` does not write."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise PlanFormatError(f"Plan.from_json takes the JSON text, not a "
                                  f"{type(text).__name__}; to read a file use Plan.load(path)")
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError(f"the JSON holds a {type(d).__name__}, not an object")
            plan = _plan_from_dict(cls, d)
        except (PlanFormatError, MeshError):
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise PlanFormatError(f"not a valid autopar plan JSON ({type(e).__name__}: "
                                  f"{str(e)[:200]}); write it with plan.save(path)") from None
        try:
            plan.report()  # what a loaded plan is for: a field it cannot explain is broken
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise PlanFormatError(f"the plan's fields do not explain ({type(e).__name__}: "
                                  f"{str(e)[:200]}); save the plan again") from None
        return plan

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`to_json` to ``path`` (UTF-8): the same plan, the same bytes."""
        try:
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(self.to_json())
        except (OSError, TypeError) as e:
            raise ArgumentError(f"cannot write the plan to `path` {path!r} ({type(e).__name__}: "
                                f"{e}); give a file path in a folder you can write to") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """The plan :meth:`save` wrote to ``path``; PlanFormatError for any other file. It
        holds the shardings (flat, see the class's attributes), the estimates and what the
        report said of the traced program (the plan in words, per layer, the collectives),
        not the program: plan the function again (or use ``parallelize(cache_dir=...)``) to
        run it,
        or hand its shardings to plain ``jax.jit``. Where the plan's devices are not in this
        process (a laptop reading a cluster's plan), its mesh is a jax ``AbstractMesh`` of
        the same axes, with a HardwareWarning: it explains itself (:meth:`report`,
        :meth:`summary`, :meth:`to_python`, :meth:`to_json`) but cannot run here."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise PlanFormatError(f"no plan file at `{path}`") from None
        except (OSError, TypeError, ValueError) as e:
            raise PlanFormatError(f"cannot read a plan from `{path}` ({type(e).__name__}: {e}); "
                                  "give the path of a file written by plan.save(path)") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PlanFormatError(f"`{path}` is not a regular file; give the path of a file "
                                      "written by plan.save(path)")
            with os.fdopen(fd, "rb") as f:
                fd = None
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PlanFormatError(f"cannot read a plan from `{path}` ({type(e).__name__}: {e}); "
                                  "give the path of a file written by plan.save(path)") from None
        finally:
            if fd is not None:
                os.close(fd)
        return cls.from_json(text)


def _json_default(x):
    """numpy scalars in stats as the Python numbers they are."""
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _tree_difference(planned_paths: list[str], args) -> str:
    """What :meth:`Plan.jit`'s caller passed in place of the planned argument tree, by the
    first leaf path that differs."""
    got = [jax.tree_util.keystr(path)
           for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    first = next((i for i, (a, b) in enumerate(zip(planned_paths, got)) if a != b),
                 min(len(planned_paths), len(got)))
    planned = planned_paths[first] if first < len(planned_paths) else "no further leaf"
    given = got[first] if first < len(got) else "no further leaf"
    return (f"arguments do not match the planned signature: {len(got)} leaves where the plan "
            f"has {len(planned_paths)}, the first difference at leaf {first} (planned "
            f"{planned}, given {given}). Plan again for these arguments.")


def _typed(shape: tuple, dtype) -> str:
    """``float32[8,128]``: a shape and dtype as text."""
    return f"{jax.numpy.dtype(dtype).name}[{','.join(map(str, shape))}]"


def _placed(x, sharding):
    """``x`` placed in its planned ``sharding`` when ``jax.jit`` would refuse it as it is: an
    array committed to other devices or another sharding (placed by ``jax.device_put``, or
    the result of another plan's program, such as a train step's parameters passed to an
    eval step planned apart), or one on a mesh with Explicit (or Manual) axes, as the
    program runs on the same devices with Auto axes (``as_auto_mesh``) and jax refuses to
    mix the two meshes in one program. Other arguments pass as they are (``jax.jit`` places
    them). Host arrays (numpy) and jax arrays not committed to a sharding (optax's ``count``
    from ``init``) are placed too: ``jax.jit`` would place them itself, but keyed apart from
    the placed arrays later calls pass (the step's own results), so the program would
    compile twice."""
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.device_put(x, sharding)
    if not isinstance(x, jax.Array):
        return x
    if on_explicit_axes(x) or not in_sharding(x, sharding):
        return jax.device_put(x, sharding)
    return x


def in_sharding(x: jax.Array, sharding) -> bool:
    """Whether ``x`` already lies as ``sharding`` places it: the same sharding, or the same
    devices and layout."""
    return x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)
