"""The `autopar` command line: demo, report, show, export, profile.

Errors print one line and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import inspect
import math
import os
import re
import stat
import sys
import traceback
import warnings

from autopar._compat import backends_initialized
from autopar._mesh import SIMULATE_FLAG, axis_sizes, simulate_cpu_devices
from autopar._progress import progress_clock, progress_line
from autopar._meshspec import parse_mesh_spec
from autopar._sizes import parse_bytes
from autopar.errors import AutoparError, AutoparWarning, CLIError, HardwareWarning

#: Each ILP solve's safety-net time limit, as ``autopar.plan(time_limit_s=...)`` defaults it.
_TIME_LIMIT_S = 300.0


def _say(msg: str) -> None:
    print(msg, flush=True)


def _xla_flags_count() -> str | None:
    """The host device count XLA_FLAGS sets (its last ``SIMULATE_FLAG``), else None."""
    counts = re.findall(re.escape(SIMULATE_FLAG) + r"=(\S*)", os.environ.get("XLA_FLAGS", ""))
    return counts[-1] if counts else None


def _simulate(n: int, asked: str) -> None:
    """Ask XLA for ``n`` simulated CPU devices; ``asked`` names who asks, for the message. A
    CLIError when XLA_FLAGS already sets another count: XLA would keep that one."""
    count = _xla_flags_count()
    if count is not None and count != str(n):
        raise CLIError(f"{asked} asks for {n} CPU devices but XLA_FLAGS sets {SIMULATE_FLAG}="
                       f"{count}, which wins: unset that flag in XLA_FLAGS or make the counts "
                       "agree")
    simulate_cpu_devices(n)


def _start_devices(simulate: int, mesh: dict[str, int]) -> None:
    """Before jax starts: ``--simulate-devices N``'s devices or, with none asked, as many CPU
    devices as ``mesh`` needs where jax will run on the CPU (JAX_PLATFORMS=cpu, or unset on a
    machine with no GPU or TPU plugin for jax)."""
    platforms = os.environ.get("JAX_PLATFORMS")
    if simulate:
        _simulate(simulate, f"--simulate-devices {simulate}")
    elif platforms == "cpu" or (not platforms and not _accelerator_plugins()):
        with warnings.catch_warnings():  # not asked for: too few devices is the mesh's error
            warnings.simplefilter("ignore", HardwareWarning)
            simulate_cpu_devices(math.prod(mesh.values()))
    _jax_starts()


def _accelerator_plugins() -> list[str]:
    """The GPU and TPU backends jax would find (its ``jax_plugins`` packages and entry points,
    and ``libtpu``), read without starting jax."""
    import importlib.metadata
    import importlib.util
    import pkgutil
    found = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        found += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    if importlib.util.find_spec("libtpu") is not None:
        found.append("libtpu")
    return found


def _jax_starts() -> None:
    """A CLIError when jax cannot start the platform it is asked for (JAX_PLATFORMS naming
    one whose jaxlib plugin is not installed, or no device of it on this machine)."""
    import jax
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        asked = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
        said = " ".join(str(e).split()) or "its backend did not start"
        raise CLIError(f"jax could not start its devices"
                       + (f" for JAX_PLATFORMS={asked}" if asked else "") + f" ({said}): "
                       "unset JAX_PLATFORMS, or install the jax for that platform (see the "
                       "README's Install)") from None


# ----- demo
_REAL_HARDWARE = """
On real hardware:
  This demo ran on simulated CPU devices, with costs from the `{hardware}` profile. On a TPU or
  GPU host, leave XLA_FLAGS and JAX_PLATFORMS unset and wrap your own step:
    step = autopar.parallelize(train_step, mesh={mesh_dict}, hardware={hardware!r},
                               donate_argnums=(0, 1))
  with a mesh as large as your device count. Built-in profiles: {profiles}.
  Or measure this machine: autopar profile --mesh {mesh_flag} --out profile.json,
  then pass --hardware profile.json (hardware='profile.json').
  To explain a plan at real sizes first (it compiles from shapes; nothing runs):
    autopar report {targets}:gpt_realistic --mesh {mesh_flag} --hardware {hardware} \\
      --html plan.html"""


def _real_hardware_hint(hardware: str, mesh: dict[str, int]) -> str:
    from autopar.cost_model.hardware import known_profiles
    return _REAL_HARDWARE.format(hardware=hardware, profiles=", ".join(known_profiles()),
                                 targets="autopar.models.targets", mesh_dict=mesh,
                                 mesh_flag=",".join(f"{a}={n}" for a, n in mesh.items()))


def _carried_hints(plan, args):
    """``plan``'s input shardings (planned for other shapes of the same model) as hints for
    ``args``: each leaf takes the spec at its path where the dims divide, else None."""
    import math

    import jax
    from jax.sharding import PartitionSpec
    sizes = axis_sizes(plan.mesh)
    by_path = dict(zip(plan.in_paths, (s.spec for s in jax.tree_util.tree_leaves(
        plan.in_shardings))))

    def hint(path, leaf):
        spec = by_path.get(jax.tree_util.keystr(path))
        if spec is None:
            return None
        axes = [() if e is None else e if isinstance(e, tuple) else (e,) for e in spec]
        return PartitionSpec(*(e if d % math.prod(sizes[a] for a in ax) == 0 else None
                               for d, e, ax in zip(leaf.shape, spec, axes)))
    return jax.tree_util.tree_map_with_path(hint, tuple(args))


def cmd_demo(args) -> int:
    _simulate(8, "the demo")
    import jax
    if not backends_initialized():  # simulated CPU devices, even on a GPU host
        jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    _jax_starts()
    import numpy as np

    import autopar
    from autopar.cost_model.hardware import get_profile
    from autopar.models import gpt, targets

    get_profile(args.hardware)  # fail early on an unknown name
    devices = jax.devices()
    if len(devices) < 8:
        raise CLIError(f"the demo needs 8 devices and {len(devices)} exist; unset XLA_FLAGS "
                       f"or set XLA_FLAGS={SIMULATE_FLAG}=8")
    _say(f"autopar demo: a GPT train step (flax linen + optax adam) on {len(devices)} "
         f"{devices[0].platform} devices, mesh data=4 x model=2\n")
    mesh = {"data": 4, "model": 2}
    # 1. At realistic widths, from shapes only: this is where sharding decisions pay.
    big_step, big_state = targets.gpt_realistic()
    _say("Planned at realistic size (hidden 1024, 16 x 512 tokens; from ShapeDtypeStructs, "
         "nothing allocated), the batch on `data`:")
    plan = autopar.plan(big_step, *big_state, mesh=mesh, hardware=args.hardware,
                        batch_axes=("data",), verbose=True)
    baselines = None
    if not args.no_baselines:
        from autopar._compare import predict_baselines
        progress_line("estimating the data-parallel and FSDP baselines")
        baselines = predict_baselines(big_step, big_state, plan.mesh, hardware=args.hardware)
    _say(plan.report(baselines))
    # 2. The same shardings on a toy GPT that runs here, checked against one device.
    step, state = gpt.make_train_step(gpt.TINY)
    params, opt_state, batch = state
    toy = autopar.plan(step, *state, mesh=mesh, hardware=args.hardware,
                       in_shardings=_carried_hints(plan, state), search=False)
    sharded = [s for s in jax.tree_util.tree_leaves(toy.in_shardings[0]) if any(s.spec)]
    run = toy.jit()
    ref_params, ref_opt = params, opt_state
    _say(f"\nTraining 3 steps of a toy GPT (hidden {gpt.TINY.hidden}) with the same shardings "
         f"({len(sharded)} of {len(jax.tree_util.tree_leaves(params))} parameters sharded), "
         "checked against the single-device step:")
    single = jax.jit(step)
    for i in range(3):
        params, opt_state, loss = run(params, opt_state, batch)
        ref_params, ref_opt, ref_loss = single(ref_params, ref_opt, batch)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree_util.tree_leaves(params),
                                   jax.tree_util.tree_leaves(ref_params)))
        _say(f"  step {i}: loss {float(loss):.5f} (single device {float(ref_loss):.5f}), "
             f"max parameter difference {diff:.2e}")
    _say(_real_hardware_hint(args.hardware, mesh))
    return 0


# ----- report
def _load_target(target: str):
    """FILE.py:NAME or MODULE:NAME -> what NAME() returns, (fn, example_args)."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise CLIError(f"target `{target}` must look like FILE.py:NAME or MODULE:NAME")
    module = _target_module(where, name)
    if not hasattr(module, name):
        raise CLIError(f"`{where}` has no `{name}`; it should define a zero-argument function "
                       f"returning (fn, example_args_tuple){_defined(module)}")
    factory = getattr(module, name)
    if not callable(factory) or inspect.isclass(factory):
        raise CLIError(f"`{name}` in `{where}` is not a function; it should be a zero-argument "
                       f"function returning (fn, example_args_tuple){_defined(module)}")
    needs = _required(factory)
    if needs:
        raise CLIError(f"`{name}` in `{where}` takes {', '.join(f'`{n}`' for n in needs)}, but a "
                       f"target is called with no arguments: it should be a zero-argument "
                       f"function returning (fn, example_args_tuple){_defined(module)}")
    with _users_code(f"`{name}()` in `{where}`"):
        made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])
            and isinstance(made[1], tuple)):
        raise CLIError(f"`{name}()` must return (fn, example_args_tuple), got "
                       f"{_describe(made)}")
    _check_traces(made, f"`{name}()`'s function")
    return made


def _defined(module) -> str:
    """``; its zero-argument functions: a, b`` (the targets ``module`` may hold), or nothing
    when it has none."""
    names = sorted(n for n, f in vars(module).items()
                   if inspect.isfunction(f) and not n.startswith("_") and not _required(f))
    return f"; its zero-argument functions: {', '.join(names)}" if names else ""


def _required(f) -> list[str]:
    """The parameters ``f`` cannot be called without (none for a signature it hides)."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _describe(made) -> str:
    if isinstance(made, tuple):
        return "(" + ", ".join(type(x).__name__ for x in made) + ")"
    name = type(made).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _check_traces(made, what: str) -> None:
    """Traces the target's function on its example arguments (shapes only; nothing runs), so
    that the user's own error is reported as theirs before planning starts."""
    import jax
    from autopar.passes.trace import check_args
    fn, example_args = made
    check_args(example_args)  # autopar's own words for a leaf jax cannot trace
    with _users_code(f"tracing {what} with its example arguments"):
        jax.eval_shape(fn, *example_args)


def _target_module(where: str, name: str):
    """The module a target names: a Python file's path, or a dotted name importable with the
    current directory first on the path (as ``python -m`` has it)."""
    import importlib.util
    if not os.path.isfile(where):
        if where.endswith(".py") or os.sep in where or "/" in where:
            raise _not_a_file(where, name)
        return _import_target(where, name)
    if not where.endswith(".py"):
        raise CLIError(f"`{where}` is not a Python file: give a `.py` file (or an importable "
                       f"module name) that defines `{name}`")
    spec = importlib.util.spec_from_file_location("_autopar_target", where)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
    with _users_code(f"running `{where}`"):
        spec.loader.exec_module(module)
    return module


def _not_a_file(where: str, name: str) -> CLIError:
    """The error for a target path that is not a file: a directory, or nothing."""
    if os.path.isdir(where):
        return CLIError(f"`{where}` is a directory: give the path of a Python file in it that "
                       f"defines `{name}`, as {os.path.join(where, 'FILE.py')}:{name}")
    return CLIError(f"no file `{where}`: give the path of a Python file holding `{name}`")


def _import_target(where: str, name: str):
    """The module ``where`` imported with the current directory first on ``sys.path``."""
    import importlib
    if os.getcwd() not in map(os.path.abspath, sys.path):
        sys.path.insert(0, os.getcwd())
    try:
        with _users_code(f"importing `{where}`"):
            return importlib.import_module(where)
    except CLIError as e:
        missing = getattr(e.__cause__, "name", None)
        if not isinstance(e.__cause__, ModuleNotFoundError) or not missing or not (
                where == missing or where.startswith(missing + ".")):
            raise
        if os.path.isdir(where):
            raise _not_a_file(where, name) from e.__cause__
        raise CLIError(f"no file or module `{where}`: no module `{missing}` is importable from "
                       f"{os.getcwd()}; give a Python file's path instead, as "
                       f"{where.replace('.', os.sep)}.py:{name}") from e.__cause__


@contextlib.contextmanager
def _users_code(doing: str):
    """Runs the user's code: whatever it raises, or a ``sys.exit``, becomes one CLIError line."""
    try:
        yield
    except AutoparError:
        raise
    except SystemExit as e:
        raise CLIError(f"{doing} called sys.exit({e.code!r}): a target must return "
                       "(fn, example_args_tuple), not exit") from e
    except Exception as e:  # the user's code: report it in one line, not as our traceback
        raise CLIError(f"{doing} failed: {type(e).__name__}: {e}") from e


def _size(text: str) -> int:
    """``--memory-budget``'s value (``autopar._sizes.parse_bytes``)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"`{text}` is not a positive number of seconds")
    return value


def _count(least: int):
    """An argparse type: an integer of at least ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"`{text}` is not an integer of at least {least}")
        return value
    return parse


def check_outputs(*outputs: tuple[str | None, str, str], reads: tuple[str, ...] = ()) -> None:
    """A CLIError, before any work, unless every given ``(path, flag, example file name)`` can
    be written (:func:`check_writable`), no two name the same file, and none names a file the
    command ``reads`` (its target's file, a profile). A None path is not given."""
    seen: dict[str, str] = {}
    read = {os.path.realpath(r) for r in reads if r and os.path.isfile(r)}
    for path, flag, example in outputs:
        if path is None:
            continue
        if not path.strip():
            raise CLIError(f"`{flag}` was given an empty path; give a file path such as "
                           f"{example}, or leave `{flag}` out")
        key = os.path.realpath(path)
        if key in read:
            raise CLIError(f"`{flag} {path}` names a file this command reads (the target or "
                           "the hardware profile); writing it would replace it: give the "
                           f"output its own path, such as {example}")
        check_writable(path, flag, example)
        if key in seen:
            raise CLIError(f"`{seen[key]}` and `{flag} {path}` name the same file: give each "
                           "output its own path")
        seen[key] = f"{flag} {path}"


def _reads(args) -> tuple[str, ...]:
    """The files a command reads that an output must not replace: the target's file and a
    hardware profile given as a path."""
    target = getattr(args, "target", None)
    return (target.rpartition(":")[0] if target else "", getattr(args, "hardware", None) or "")


def check_writable(path: str, flag: str, example: str = "plan.json") -> None:
    """A CLIError, before any work, when ``flag``'s output ``path`` cannot be written: its
    folder is missing, the path is a folder or another non-file, or opening it for writing
    fails (the file is tried, and left as it was). ``example`` names a file the message
    suggests in place of a folder."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder):
        raise CLIError(f"cannot write `{flag} {path}`: folder `{folder}` does not exist; "
                       "create it or give another path")
    if os.path.isdir(path):
        raise CLIError(f"cannot write `{flag} {path}`: it is a folder; give a file path "
                       f"such as {os.path.join(path, example)}")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise CLIError(f"cannot write `{flag} {path}`: it is not a regular file; give a "
                       "file path")
    try:
        if os.path.exists(path):
            open(path, "a").close()   # no write: the file keeps its text
        else:
            open(path, "x").close()
            os.remove(path)
    except OSError as e:
        raise CLIError(f"cannot write `{flag} {path}`: opening it for writing failed "
                       f"({e.strerror or e}); {_os_error_fix(e)}") from None


def _os_error_fix(e: OSError) -> str:
    """What to do about a failed write, from its errno."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space or give another path"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "give a path in a folder you can write to"
    return "give another path"


@contextlib.contextmanager
def _writing(path: str, flag: str):
    """An OSError while writing ``flag``'s ``path`` (a full disk, say) becomes a CLIError."""
    try:
        yield
    except OSError as e:
        raise CLIError(f"writing `{flag} {path}` failed: {e.strerror or e}; "
                       f"{_os_error_fix(e)}") from None


def write_output(path: str, flag: str, text: str) -> None:
    """``text`` written to ``path``; an OSError is a CLIError (:func:`_writing`)."""
    with _writing(path, flag), open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _positions(text: str) -> tuple[int, ...]:
    """``batch_argnums``'s value in ``--pipeline``: argument positions joined by ``+``."""
    return tuple(_count(0)(part) for part in text.split("+"))


#: ``--pipeline``'s fields, as ``autopar.Pipeline`` takes them: name -> its value's parser.
_PIPELINE_FIELDS = {"axis": str, "stages": _count(1), "microbatches": _count(1),
                    "schedule": str, "virtual_stages": _count(1), "batch_argnums": _positions}


def _pipeline_option(text: str) -> str | dict:
    """``--pipeline``'s value: ``auto``, ``off`` (or ``none``, as ``pipeline=None``), or the
    fields of an ``autopar.Pipeline`` as ``axis=stage,schedule=1f1b,microbatches=8,
    batch_argnums=1+2`` (a first field without ``=`` is the axis; ``axis=none`` names an axis
    called none). Fields are checked here; the ``Pipeline`` is made once jax may be
    imported."""
    if text in ("auto", "off", "none"):
        return "off" if text == "none" else text
    fields: dict[str, str | int] = {}
    for k, part in enumerate(text.split(",")):
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq and k == 0:
            name, value = "axis", name
        if name not in _PIPELINE_FIELDS or not value or name in fields:
            raise argparse.ArgumentTypeError(
                f"`{text}` is not auto, off or pipeline fields like "
                f"axis=stage,schedule=1f1b,microbatches=8 (fields: "
                f"{', '.join(_PIPELINE_FIELDS)})")
        fields[name] = _PIPELINE_FIELDS[name](value)
    return fields


def _logical_axis_rules_option(text: str) -> list[tuple[str, str | tuple[str, ...] | None]]:
    """``--logical-axis-rules``' value as ``plan(logical_axis_rules=...)`` takes it:
    ``batch=data,mlp=model,embed=none,heads=data+model`` (``none``: replicated; ``a+b``: split
    over both axes, in that order)."""
    rules: list[tuple[str, str | tuple[str, ...] | None]] = []
    for part in text.split(","):
        name, eq, value = (s.strip() for s in part.partition("="))
        axes = [a.strip() for a in value.split("+")]
        if not eq or not name or not all(axes):
            raise argparse.ArgumentTypeError(
                f"`{text}` is not logical axis rules like batch=data,mlp=model,embed=none "
                f"(a logical name, `=`, then a mesh axis, `none`, or axes joined by `+`)")
        rules.append((name, None if value == "none" else
                      axes[0] if len(axes) == 1 else tuple(axes)))
    return rules


def _pipeline_setting(option: str | dict):
    """``autopar.plan(pipeline=...)`` for a parsed ``--pipeline``."""
    if option == "auto":
        return "auto"
    if option == "off":
        return None
    import autopar
    return autopar.Pipeline(**option)


#: ``--remat`` choices, as ``autopar.plan(remat=...)`` takes them.
_REMAT = {"auto": True, "off": False, "dots_saveable": "dots_saveable",
          "nothing_saveable": "nothing_saveable"}


def _loading(args) -> None:
    """The first progress line of a command that plans a target: jax's start and the target's
    own code take seconds before planning says anything."""
    if not args.quiet:
        progress_line(f"starting jax and loading {args.target}")


def cmd_report(args) -> int:
    mesh = parse_mesh_spec(args.mesh)
    check_outputs((args.json, "--json", "plan.json"), (args.html, "--html", "plan.html"),
                  reads=_reads(args))
    _loading(args)
    _start_devices(args.simulate_devices, mesh)
    import autopar
    from autopar.cost_model.hardware import get_profile
    get_profile(args.hardware)  # fail early on an unknown name
    fn, example_args = _load_target(args.target)
    plan = autopar.plan(fn, *example_args, mesh=mesh, hardware=args.hardware,
                        memory_budget=args.memory_budget, remat=_REMAT[args.remat],
                        logical_axis_rules=args.logical_axis_rules,
                        time_limit_s=args.time_limit, verbose=not args.quiet,
                        pipeline=_pipeline_setting(args.pipeline),
                        overlap=not args.no_overlap)
    baselines = None
    if not args.no_baselines:
        from autopar._compare import predict_baselines
        if not args.quiet:
            progress_line("estimating the data-parallel and FSDP baselines")
        baselines = predict_baselines(fn, example_args, plan.mesh, hardware=args.hardware)
    _say(plan.report(baselines))
    if args.validate:
        from autopar._validate import validation_table
        if not args.quiet:
            progress_line("compiling the plan to check the prediction")
        _say("\n" + validation_table(plan))
    if args.json:   # with its baselines' estimates, which `autopar show` shows beside it
        from autopar._report import with_baselines
        write_output(args.json, "--json", with_baselines(plan, baselines).to_json())
        _say(f"\nwrote {args.json}")
    if args.html:
        from autopar._html import render_html
        write_output(args.html, "--html", render_html(plan, baselines))
        _say(f"wrote {args.html}")
    return 0


# ----- show
def cmd_show(args) -> int:
    """Explain a plan saved by ``report --json`` or ``Plan.save``, here or on any machine:
    where its devices are not, it is read on its mesh's axes alone (``Plan.load``)."""
    check_outputs((args.html, "--html", "plan.html"), reads=(args.plan,))
    if args.simulate_devices:   # the devices it was planned on, simulated as when planned
        _simulate(args.simulate_devices, f"--simulate-devices {args.simulate_devices}")
    import jax
    if not backends_initialized():  # reading a file needs no accelerator (nor to take one)
        jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    import autopar
    from autopar._html import render_html
    with warnings.catch_warnings():   # read, not run: the report says where its devices are
        warnings.simplefilter("ignore", HardwareWarning)
        plan = autopar.Plan.load(args.plan)
    _say(plan.report())
    if args.html:
        write_output(args.html, "--html", render_html(plan))
        _say(f"\nwrote {args.html}")
    return 0


# ----- export
def cmd_export(args) -> int:
    """Plan FILE.py:NAME and write the plan as a standalone module for plain ``jax.jit``."""
    mesh = parse_mesh_spec(args.mesh)
    check_outputs((args.out, "--out", "plan_specs.py"), reads=_reads(args))
    module = _module_name(args.out)
    _loading(args)
    _start_devices(args.simulate_devices, mesh)
    import autopar
    from autopar._report import hardware_words, mesh_words
    from autopar.cost_model.hardware import get_profile
    get_profile(args.hardware)  # fail early on an unknown name
    fn, example_args = _load_target(args.target)
    plan = autopar.plan(fn, *example_args, mesh=mesh, hardware=args.hardware,
                        memory_budget=args.memory_budget, time_limit_s=args.time_limit,
                        logical_axis_rules=args.logical_axis_rules,
                        verbose=not args.quiet, exportable=not args.pinned)
    if not args.quiet:
        progress_line("compiling the plan and plain jax.jit with its shardings to compare")
    with _writing(args.out, "--out"):
        text = plan.to_python(args.out, fn=fn)
    _say(f"autopar plan on mesh {mesh_words(plan)}, {hardware_words(plan)}")
    _say(plan.summary())
    for line in text.splitlines():
        if line.startswith("Checked when written"):
            _say(line)
    _say(f"wrote {args.out}: run it with `import {module} as plan; mesh = plan.make_mesh(); "
         "jax.jit(fn, in_shardings=plan.in_shardings(mesh), "
         "out_shardings=plan.out_shardings(mesh))`")
    return 0


def _module_name(path: str) -> str:
    """The module name ``export --out PATH`` is imported by; a CLIError unless PATH is a
    ``.py`` file whose name is one."""
    import keyword
    stem, ext = os.path.splitext(os.path.basename(path))
    if ext != ".py" or not stem.isidentifier() or keyword.iskeyword(stem):
        fixed = "_".join("".join(c if c.isalnum() else " " for c in stem).split()) or "plan"
        fixed = fixed if fixed.isidentifier() and not keyword.iskeyword(fixed) else "plan_specs"
        raise CLIError(f"`--out {path}` must be a Python module to import: a `.py` file whose "
                       f"name is a Python identifier, such as {fixed}.py")
    return stem


# ----- profile
def cmd_profile(args) -> int:
    mesh = parse_mesh_spec(args.mesh)
    check_outputs((args.out, "--out", "profile.json"), reads=_reads(args))
    if args.min_bytes > args.max_bytes:
        raise CLIError(f"`--min-bytes {args.min_bytes}` is over `--max-bytes {args.max_bytes}`: "
                       "give a smallest message no larger than the largest")
    _start_devices(args.simulate_devices, mesh)
    from autopar.cost_model.profiler import profile
    prof = profile(mesh, base=args.base, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                   repeats=args.repeats, verbose=not args.quiet)
    write_output(args.out, "--out", prof.to_json())
    _say(f"wrote {args.out}: pass it as --hardware {args.out} (or hardware=\"{args.out}\")")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("autopar")
    except PackageNotFoundError:
        return "0+unknown (not installed)"


def _add_planning_arguments(parser: argparse.ArgumentParser) -> None:
    """The target and the planning flags ``report`` and ``export`` share, with their defaults
    (those of ``autopar.plan``) in the help."""
    parser.add_argument("target", help="FILE.py:NAME or MODULE:NAME, NAME a zero-argument "
                                       "function returning (fn, example_args_tuple)")
    parser.add_argument("--mesh", required=True, help="e.g. data=2,model=4")
    parser.add_argument("--hardware", default=None,
                        help="profile name or profile JSON path (default: this backend's, as "
                             "plan())")
    parser.add_argument("--memory-budget", type=_size, default=None, metavar="SIZE",
                        help="per-device memory the plan must fit in, e.g. 40GiB (checked "
                             "against the compiled program); default: the hardware profile's "
                             "memory less 10%%, as predicted")
    parser.add_argument("--time-limit", type=_positive_seconds, default=_TIME_LIMIT_S,
                        metavar="SECONDS",
                        help=f"a safety net on each ILP solve's wall-clock time (default "
                             f"{_TIME_LIMIT_S:g}; solves are bounded by work, so plans do not "
                             "depend on load)")
    parser.add_argument("--logical-axis-rules", type=_logical_axis_rules_option,
                        default=None, metavar="RULES",
                        help="how flax's logical axis names map to mesh axes, e.g. "
                             "batch=data,mlp=model,embed=none (none: replicated; data+model: "
                             "both), as plan(logical_axis_rules=...); default: each box's own "
                             "rules, else flax's context")
    parser.add_argument("--simulate-devices", type=_count(1), default=0, metavar="N",
                        help="run on N simulated CPU devices (default: the devices present; "
                             "where jax runs on the CPU (no GPU or TPU plugin installed, or "
                             "JAX_PLATFORMS=cpu), as many as the mesh needs)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (not the usage block above it), as every
    other failure of the command is; the subcommands' parsers are of this class too."""

    def error(self, message: str, prog: str | None = None):
        print(f"autopar: error: {message} (see `{prog or self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="show Python tracebacks (accepted anywhere on the line)")
    parser.add_argument("--version", action="version", version=f"autopar {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = _command(sub, "demo", "plan and run the bundled GPT example on 8 simulated "
                                 "CPU devices")
    demo.add_argument("--hardware", default="h100",
                      help="hardware profile to plan for (default: h100)")
    demo.add_argument("--no-baselines", action="store_true",
                      help="skip estimating the data-parallel and FSDP baselines")
    demo.set_defaults(run=cmd_demo)
    rep = _command(sub, "report", "plan FILE.py:NAME and explain the plan")
    _add_planning_arguments(rep)
    rep.add_argument("--json", help="write the plan as JSON to this path")
    rep.add_argument("--html", help="write a self-contained HTML report to this path")
    rep.add_argument("--no-baselines", action="store_true",
                     help="skip estimating the data-parallel and FSDP baselines")
    rep.add_argument("--validate", action="store_true",
                     help="compile the plan and compare the prediction with the compiled HLO")
    rep.add_argument("--remat", choices=tuple(_REMAT), default="auto",
                     help="rematerialize layers when no sharding fits the budget (auto), "
                          "never (off), or every layer with this policy (default: auto)")
    rep.add_argument("--pipeline", type=_pipeline_option, default="auto",
                     metavar="{auto,off,FIELDS}",
                     help="cut the step's scanned layers into pipeline stages: auto (when its "
                          "compiled program is faster; the default, as plan()), off (or "
                          "none), or autopar.Pipeline's fields: an axis alone (stage), or "
                          "axis=stage,schedule=1f1b,microbatches=8,batch_argnums=1+2 (the "
                          "loss must be marked with autopar.value_and_grad)")
    rep.add_argument("--no-overlap", action="store_true",
                     help="no rewrite that hides communication behind compute (collective "
                          "matmul, weight prefetch), as plan(..., overlap=False)")
    rep.set_defaults(run=cmd_report)
    show = _command(sub, "show", "explain a plan saved by report --json or Plan.save, "
                                 "on any machine (as it was made, its baselines too)")
    show.add_argument("plan", help="the plan's JSON file")
    show.add_argument("--html", help="write a self-contained HTML report to this path")
    show.add_argument("--simulate-devices", type=_count(1), default=0, metavar="N",
                      help="read the plan on N simulated CPU devices, as a plan made with "
                           "--simulate-devices N was (default: the devices present)")
    show.set_defaults(run=cmd_show)
    exp = _command(sub, "export", "plan FILE.py:NAME and write the plan as a Python "
                                  "module (MESH, IN_SPECS, OUT_SPECS) for plain jax.jit")
    _add_planning_arguments(exp)
    exp.add_argument("--out", required=True, help="the .py file to write")
    exp.add_argument("--pinned", action="store_true",
                     help="write the searched plan, whose intermediate shardings plain jax.jit "
                          "does not reproduce (default: a plan plain jax.jit runs as planned, "
                          "as plan(..., exportable=True) makes)")
    exp.set_defaults(run=cmd_export)
    prof = _command(sub, "profile", "measure this machine's matmuls, memory and "
                                    "collectives and write a hardware profile JSON")
    prof.add_argument("--mesh", required=True, help="e.g. data=2,model=4 (the axes to measure)")
    prof.add_argument("--out", required=True, help="the profile JSON to write")
    prof.add_argument("--base", default=None,
                      help="built-in profile for what is not measured (default: this backend's)")
    prof.add_argument("--min-bytes", type=_count(1), default=2**10,
                      help="smallest message (bytes; default 1024)")
    prof.add_argument("--max-bytes", type=_count(1), default=2**26,
                      help="largest message (bytes; default 64 MiB)")
    prof.add_argument("--repeats", type=_count(1), default=5,
                      help="timed runs per measurement (default 5)")
    prof.add_argument("--simulate-devices", type=_count(1), default=0, metavar="N",
                      help="run on N simulated CPU devices")
    prof.add_argument("--quiet", action="store_true", help="no progress lines")
    prof.set_defaults(run=cmd_profile)
    return parser


def _command(sub, name: str, said: str) -> argparse.ArgumentParser:
    """The subcommand ``name``: ``said`` in ``autopar --help``'s list, and first in its own."""
    return sub.add_parser(name, help=said, description=f"{said[0].upper()}{said[1:]}.")


def main(argv=None) -> int:
    """Runs the command ``argv`` and returns its exit status: 2 for bad input (an
    AutoparError), 1 for anything else. Every failure is one line on stderr. ``--debug``
    (anywhere on the line) adds the traceback: on the command line (``argv`` None, read from
    ``sys.argv``) it is printed above that line and the status stays the same; a caller
    passing ``argv`` gets the exception raised instead."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    if not argv:  # `autopar` alone: what it can do
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the command's own help, where its flags are
        parser.error(f"unrecognized arguments: {' '.join(extra)}", f"autopar {args.command}")
    try:
        with _warnings_as_lines(from_command_line and not debug), progress_clock():
            return args.run(args)
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped (`autopar report ... | head`): no error
        _silence_stdout()
        return 141  # 128 + SIGPIPE, as a shell reports a program its pipe closed
    except Exception as e:
        if debug and not from_command_line:
            raise
        if debug:
            traceback.print_exc()
        print(f"autopar: error: {_one_line(e, debug)}", file=sys.stderr)
        return 2 if isinstance(e, AutoparError) else 1


@contextlib.contextmanager
def _warnings_as_lines(on: bool):
    """With ``on``, each of autopar's warnings is one line on stderr, ``autopar: warning:
    <Category>: <message>``, once per command, not Python's file, line and source
    (``--debug`` keeps those)."""
    if not on:
        yield
        return
    shown, said = warnings.showwarning, set()

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, AutoparWarning):
            return shown(message, category, filename, lineno, file, line)
        said_text = " ".join(str(message).split()).removeprefix("autopar: ")
        text = f"{category.__name__}: {_with_flags(said_text)}"
        if text not in said:
            said.add(text)
            print(f"autopar: warning: {text}", file=file or sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush at exit does
    not fail again on the closed pipe."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object (tests)
        pass


def _one_line(e: Exception, debug: bool = False) -> str:
    """The message of ``e``, as a user reads it: an AutoparError's own, anything else (a
    failure in autopar or the runtime) named by its type, with where to look further
    (``debug``: the traceback is shown above it already)."""
    if isinstance(e, AutoparError):  # one line, even where it quotes the user's message
        return " ".join(_with_flags(str(e)).split())
    if isinstance(e, MemoryError):
        return ("out of host memory: plan on abstract arguments (jax.ShapeDtypeStruct), a "
                "smaller model, or a machine with more memory")
    if isinstance(e, OSError):
        where = f" `{e.filename}`" if e.filename else ""
        return (f"{type(e).__name__}{where}: {e.strerror or e}; check the path, its "
                "permissions and the free space")
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:300] + " ..."
    rerun = "the traceback is above" if debug else "rerun with --debug for the traceback"
    return (f"{type(e).__name__}: {text} (unexpected; {rerun}, and report it if it comes "
            "from autopar)")


#: Python spellings of plan()'s options that error messages suggest, and each one's flag.
_FLAGS = ((re.compile(r"`pipeline=None`"), "`--pipeline off`"),
          (re.compile(r"`(?:autopar\.)?Pipeline\((" + "|".join(_PIPELINE_FIELDS)
                      + r")=\\?\"?([\w.+-]+)\\?\"?\)`"), r"`\1=\2` in `--pipeline`"),
          (re.compile(r"`overlap=False`"), "`--no-overlap`"),
          (re.compile(r"`memory_budget`"), "`--memory-budget`"),
          (re.compile(r"`hardware=`"), "`--hardware PATH`"),
          (re.compile(r"`time_limit_s`"), "`--time-limit`"),
          (re.compile(r"`logical_axis_rules=\[[^`]*\]`"), "`--logical-axis-rules batch=data,...`"),
          (re.compile(r"`remat=True`"), "`--remat auto`"))


def _with_flags(text: str) -> str:
    """``text`` with each of plan()'s options it suggests followed by its flag, where it is
    first named: "`pipeline=None` (CLI: `--pipeline off`)"."""
    for pattern, flag in _FLAGS:
        text = pattern.sub(lambda m, flag=flag: f"{m[0]} (CLI: {m.expand(flag)})", text, count=1)
    return text


if __name__ == "__main__":
    sys.exit(main())
