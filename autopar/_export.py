"""A plan as a standalone Python module a user commits and runs with plain ``jax.jit``.

The module defines ``MESH`` (axis name -> size), ``IN_SPECS`` and ``OUT_SPECS`` (PartitionSpec
pytrees shaped like the arguments and the results), ``LOGICAL_AXIS_RULES`` and helpers that
make the mesh and the NamedShardings. It imports only jax, numpy and the classes of the
argument pytrees (optax states, ...). Pytree nodes it cannot write as code (a class defined
in a function, a dataclass with static fields) make it write the specs flat, in
``jax.tree_util`` order, with ``in_shardings(mesh, like=args)`` to rebuild the trees.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autopar._mesh import axis_sizes
from autopar._sizes import format_bytes, format_seconds
from autopar.cost_model.hlo import HloSummary, analyze
from autopar.cost_model.spec import pspec_text
from autopar.errors import ArgumentError


class _NotCode(Exception):
    """A pytree node with no plain-code form."""


def _class_name(obj, imports: set[str]) -> str:
    cls = type(obj)
    module, name = cls.__module__, cls.__qualname__
    if "." in name or "<" in name or module in ("__main__", "builtins"):
        raise _NotCode(f"{module}.{name}")
    if _exported_by(module, name) is not cls:
        raise _NotCode(f"{module}.{name}")
    package = module.partition(".")[0]
    public = package if _exported_by(package, name) is cls else module
    imports.add(f"from {public} import {name}")
    return name


def _exported_by(module: str, name: str):
    """``module.name`` (None when the module does not import or has no such name)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _code(obj, imports: set[str], indent: int = 0) -> str:
    """Python source that builds ``obj`` (a pytree of NamedSharding leaves) with specs."""
    pad, inner = "    " * indent, "    " * (indent + 1)
    if isinstance(obj, NamedSharding):
        return pspec_text(obj.spec)
    if obj is None:
        return "None"
    if isinstance(obj, dict) and all(isinstance(k, (str, int)) for k in obj):
        body = "".join(f"{inner}{k!r}: {_code(v, imports, indent + 1)},\n"
                       for k, v in obj.items())
        literal = "{\n" + body + pad + "}" if obj else "{}"
        return literal if type(obj) is dict else f"{_class_name(obj, imports)}({literal})"
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):   # a NamedTuple
        name = _class_name(obj, imports)
        if not obj:
            return f"{name}()"
        body = "".join(f"{inner}{f}={_code(v, imports, indent + 1)},\n"
                       for f, v in zip(obj._fields, obj))
        return f"{name}(\n{body}{pad})"
    if type(obj) in (tuple, list):
        items = "".join(f"{inner}{_code(v, imports, indent + 1)},\n" for v in obj)
        open_, close = ("(", ")") if type(obj) is tuple else ("[", "]")
        return f"{open_}\n{items}{pad}{close}" if obj else f"{open_}{close}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)[0]
        fields = [f for f in dataclasses.fields(obj) if f.init]
        if len(children) != len(fields):   # static fields: cannot be rebuilt from specs
            raise _NotCode(type(obj).__qualname__)
        name = _class_name(obj, imports)
        body = "".join(f"{inner}{f.name}={_code(getattr(obj, f.name), imports, indent + 1)},\n"
                       for f in fields)
        return f"{name}(\n{body}{pad})"
    raise _NotCode(type(obj).__qualname__)


_TEMPLATE = '''"""Sharding plan for `{fn}` on mesh {mesh_words}, written by autopar.

{opening}::

    import jax
    import {module} as plan
    mesh = plan.make_mesh()
    step = jax.jit({fn}, in_shardings=plan.in_shardings(mesh{like_in}),
                   out_shardings=plan.out_shardings(mesh{like_out}))

Predicted per device on the `{hardware}` profile: step {step}, peak memory {peak}.
{verdict}{words}
"""

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
{imports}
#: Mesh axis name -> size, major to minor (devices are laid out in ``jax.devices()`` order).
MESH = {mesh!r}

{specs}

#: MaxText-style (logical axis, mesh axes) rules for the logical axis names the parameters
#: carry (flax metadata), when the plan splits each name alike wherever it occurs; else None.
{rules_why}LOGICAL_AXIS_RULES = {rules}


def make_mesh(devices=None) -> Mesh:
    """The plan's mesh over ``devices`` (default: all of ``jax.devices()``, in order)."""
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(MESH.values())
    if len(devices) < n:
        raise ValueError(f"the plan's mesh {{MESH}} needs {{n}} devices, {{len(devices)}} given")
    return Mesh(np.asarray(devices[:n]).reshape(tuple(MESH.values())), tuple(MESH),
                axis_types=(AxisType.Auto,) * len(MESH))


def named(specs, mesh: Mesh):
    """The PartitionSpec pytree ``specs`` as NamedShardings on ``mesh``."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))
{helpers}'''

_TREE_HELPERS = '''

def in_shardings(mesh: Mesh | None = None):
    """``jax.jit``'s ``in_shardings``: NamedShardings shaped like the arguments."""
    return named(IN_SPECS, mesh if mesh is not None else make_mesh())


def out_shardings(mesh: Mesh | None = None):
    """``jax.jit``'s ``out_shardings``: NamedShardings shaped like the results."""
    return named(OUT_SPECS, mesh if mesh is not None else make_mesh())
'''

_FLAT_HELPERS = '''

def in_shardings(mesh: Mesh | None = None, like=None):
    """``jax.jit``'s ``in_shardings`` for arguments shaped like ``like`` (the tuple of
    arguments, or ShapeDtypeStructs of them): IN_SPECS_FLAT in their tree."""
    return _in_tree(IN_SPECS_FLAT, mesh, like, "arguments")


def out_shardings(mesh: Mesh | None = None, like=None):
    """``jax.jit``'s ``out_shardings`` for results shaped like ``like`` (the results, or
    ``jax.eval_shape`` of the step)."""
    return _in_tree(OUT_SPECS_FLAT, mesh, like, "results")


def _in_tree(specs, mesh, like, what):
    if like is None:
        raise TypeError(f"the specs here are flat (the {what}' trees could not be written as "
                        f"code): pass like= the {what} (or ShapeDtypeStructs of them)")
    tree = jax.tree_util.tree_structure(like)
    if tree.num_leaves != len(specs):
        raise ValueError(f"like= has {tree.num_leaves} leaves; the plan's {what} have "
                         f"{len(specs)}")
    mesh = mesh if mesh is not None else make_mesh()
    return jax.tree_util.tree_unflatten(tree, [NamedSharding(mesh, s) for s in specs])
'''


def _flat_code(name: str, paths, tree) -> str:
    leaves = jax.tree_util.tree_leaves(tree)
    body = "".join(f"    {pspec_text(s.spec)},  # {p}\n" for p, s in zip(paths, leaves))
    return f"{name} = [\n{body}]"


def _specs_code(plan, imports: set[str]) -> tuple[str, bool]:
    """(the code defining the specs, whether it is the pytree form)."""
    try:
        if plan._in_tree is None:   # loaded from JSON: flat shardings, no trees
            raise _NotCode("a plan loaded from JSON")
        ins = _code(plan.in_shardings, imports)
        outs = _code(plan.out_shardings, imports)
        return ("#: PartitionSpecs shaped like the arguments (a tuple, one entry per argument).\n"
                f"IN_SPECS = {ins}\n\n#: PartitionSpecs shaped like the results.\n"
                f"OUT_SPECS = {outs}"), True
    except _NotCode as e:
        imports.clear()
        return (f"# The arguments' trees ({e}) cannot be written as code: the specs are\n"
                "# flat, in jax.tree_util order, each with its path.\n"
                + _flat_code("IN_SPECS_FLAT", plan.in_paths, plan.in_shardings) + "\n\n"
                + _flat_code("OUT_SPECS_FLAT", plan.out_paths, plan.out_shardings)), False


def _rules_code(rules) -> str:
    if not rules:
        return "None"
    return "[\n" + "".join(f"    {r!r},\n" for r in rules) + "]"


def plan_rules(plan) -> tuple[list | None, str]:
    """(the plan's logical axis rules or None, a comment saying why there are none)."""
    names = plan.stats.get("logical_axes")
    if not names:
        return None, "the arguments carry no logical axis names (flax metadata)"
    specs = [s.spec for s in jax.tree_util.tree_leaves(plan.in_shardings)]
    rules, unclean = logical_rules(names, specs)
    if rules is None:
        return None, ("the plan splits " + ", ".join(repr(n) for n in unclean)
                      + " over different mesh axes in different places")
    return rules, ""


def module_source(plan, module: str = "plan_specs", fn_name: str = "step",
                  words: list[str] | None = None, verdict: str = "") -> str:
    """The text of the module (see the module docstring)."""
    imports: set[str] = set()
    rules, why = plan_rules(plan)
    specs, as_tree = _specs_code(plan, imports)
    mesh = {str(a): int(n) for a, n in axis_sizes(plan.mesh).items()}
    said = "\nThe plan in words:\n" + "".join(f"  {w}\n" for w in words) if words else ""
    return _TEMPLATE.format(
        fn=fn_name, module=module, opening=_opening(verdict), hardware=plan.hardware, mesh=mesh,
        mesh_words=" x ".join(f"{a}={n}" for a, n in mesh.items()),
        step=format_seconds(plan.estimate.step_time_s),
        peak=format_bytes(plan.estimate.peak_memory_bytes), words=said.rstrip("\n"),
        verdict=f"\n{verdict}\n" if verdict else "",
        imports="".join(f"{i}\n" for i in sorted(imports)), specs=specs,
        rules=_rules_code(rules), rules_why=f"# None: {why}.\n" if why else "",
        helpers=_TREE_HELPERS if as_tree else _FLAT_HELPERS,
        like_in="" if as_tree else ", like=args",
        like_out="" if as_tree else ", like=jax.eval_shape({}, *args)".format(fn_name))


def write_module(plan, path: str | os.PathLike, fn_name: str = "step",
                 words: list[str] | None = None, verdict: str = "") -> str:
    """Write :func:`module_source` to ``path``; returns the text written."""
    module = os.path.splitext(os.path.basename(os.fspath(path)))[0] or "plan_specs"
    text = module_source(plan, module, fn_name, words, verdict)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except (OSError, TypeError) as e:
        raise ArgumentError(f"cannot write the module to `path` {path!r} ({type(e).__name__}: "
                            f"{e}); give a file path in a folder you can write to") from None
    return text


_SAME = ("Checked when written: plain jax.jit with these shardings compiles to the plan's "
         "collectives.")
_DIFFERS = ("Checked when written: plain jax.jit with these shardings compiles to other "
            "collectives than the plan")


def _opening(verdict: str) -> str:
    """The docstring's first instruction, true to ``verdict`` (:func:`plain_jit_check`'s
    sentence, or "" when unchecked)."""
    if verdict.startswith(_SAME):
        return ("Run it with plain jax (the program XLA compiles from these shardings is the\n"
                "plan's, as checked below)")
    if verdict.startswith(_DIFFERS):
        return ("Run it with plain jax: these specs compute the same numbers as the plan, but\n"
                "XLA compiles other collectives from them, as the check below says")
    return ("Run it with plain jax (XLA infers the shardings inside the step from these, so\n"
            "the program may communicate otherwise than the plan)")


def collective_signature(summary: HloSummary) -> list[tuple]:
    """The compiled collectives as a sorted list of (kind, group size, bytes in, bytes out,
    executions): two programs with equal signatures communicate alike."""
    return sorted((c.kind.value, c.group_size, c.in_bytes, c.out_bytes, c.trip_count)
                  for c in summary.collectives)


def plain_jit_check(plan, fn) -> tuple[bool, str]:
    """Compile ``fn`` with plain ``jax.jit`` and the plan's in/out shardings (what the
    exported module gives; an exportable plan keeps what its choice compiled of the same
    ``fn``) and compare its collectives with the plan's program: (whether they are the same,
    a sentence saying so). jax propagates shardings from the arguments and
    results; where the plan splits an intermediate otherwise, the programs differ."""
    kept = plan._plain_summary
    if kept is not None and kept[0] is fn:   # exportable planning compiled it to choose
        plain = kept[1]
    else:
        flat = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in
                zip(plan._arg_avals, jax.tree_util.tree_leaves(plan.in_shardings))]
        abstract = jax.tree_util.tree_unflatten(plan._in_tree, flat)
        plain = analyze(jax.jit(fn, in_shardings=plan.in_shardings,
                                out_shardings=plan.out_shardings).lower(*abstract).compile())
    planned = analyze(plan.compile())
    if collective_signature(plain) == collective_signature(planned):
        return True, _SAME
    kinds = {k.value: v for k, v in plain.by_kind().items()}
    want = {k.value: v for k, v in planned.by_kind().items()}
    return False, (f"{_DIFFERS} ({_kinds(kinds)}, the plan {_kinds(want)}): the "
                   "plan also splits intermediate values, which jax does not infer from the "
                   "arguments and results alone. autopar's plan.jit() runs the plan itself; "
                   "a plan made with `exportable=True` runs under plain jax.jit as planned.")


def _kinds(by_kind: dict) -> str:
    return ", ".join(f"{n} {k} moving {format_bytes(b)}" for k, (n, b) in sorted(by_kind.items())) or "none"


# ----- logical axis rules
def logical_names(args) -> list[list | None] | None:
    """Per leaf of ``args`` (``jax.tree_util`` order), the logical axis names its flax
    metadata gives (linen ``nn.with_logical_partitioning``, nnx ``sharding=``), else None;
    None when no leaf has any. Only flax modules already imported are looked for."""
    meta, nnx = sys.modules.get("flax.linen.spmd"), sys.modules.get("flax.nnx")
    boxes = ((meta.LogicallyPartitioned,) if meta is not None else ()) + (
        (nnx.Variable,) if nnx is not None else ())
    if not boxes:
        return None
    out: list[list | None] = []
    for node in jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, boxes)):
        names = None
        if meta is not None and isinstance(node, meta.LogicallyPartitioned):
            names = list(node.names)
        elif nnx is not None and isinstance(node, nnx.Variable):
            md = node.get_metadata()
            names = md.get("out_sharding") or md.get("sharding")
            names = list(names) if names else None
        n = len(jax.tree_util.tree_leaves(node)) if isinstance(node, boxes) else 1
        out += [names] * n
    return out if any(out) else None


def logical_rules(names: list, specs: list) -> tuple[list | None, list[str]]:
    """(MaxText-style ``[(logical, mesh axes or None), ...]``, the logical names the plan
    splits inconsistently) from each leaf's logical names and its PartitionSpec. The rules
    exist when every logical name is split over the same mesh axes wherever it occurs."""
    seen: dict[str, set] = {}
    for leaf_names, spec in zip(names, specs):
        if not leaf_names:
            continue
        entries = list(spec) + [None] * (len(leaf_names) - len(spec))
        for name, entry in zip(leaf_names, entries):
            if name is not None:
                axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
                seen.setdefault(name, set()).add(axes)
    unclean = sorted(n for n, axes in seen.items() if len(axes) > 1)
    if not seen or unclean:
        return None, unclean
    rules = []
    for name, (axes,) in seen.items():
        rules.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return rules, []
