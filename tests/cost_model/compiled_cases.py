"""Plans of the realistic workloads and their compiled programs, made once per test session
and shared by the estimate and ranking tests (planning and compiling is what takes time)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import autopar
from autopar._mesh import as_auto_mesh
from autopar._compare import baseline_kinds, compile_baseline, predict_baselines
from autopar.cost_model.hardware import get_profile
from autopar.cost_model.hlo import HloSummary, analyze
from autopar.models.workloads import abstract_train_step

MESHES = {"1d": {"data": 8}, "2d": {"data": 2, "model": 4}}
H100 = get_profile("h100")


@dataclass(frozen=True)
class Case:
    plan: autopar.Plan
    truth: HloSummary      # of the plan's own compiled program
    hlo_text: str          # that program's compiled text


@functools.cache
def autopar_case(model: str, mesh: str) -> Case:
    """autopar's plan for workload ``model`` on mesh ``mesh`` ("1d" or "2d"), compiled."""
    fn, args = abstract_train_step(model)
    plan = autopar.plan(fn, *args, mesh=as_auto_mesh(MESHES[mesh]), hardware=H100)
    return _case(plan, plan.compile())


@functools.cache
def baseline_cases(model: str, mesh: str) -> dict[str, Case]:
    """For each hand-written baseline that applies (``autopar.baselines.baseline_kinds``): the
    hand-written program (``jax.jit`` with the baseline's shardings) compiled, beside autopar's
    prediction of it (``autopar._compare.predict_baselines``: the baseline's shardings
    propagated, ``search=False``)."""
    fn, args = abstract_train_step(model)
    jax_mesh = as_auto_mesh(MESHES[mesh])
    plans = predict_baselines(fn, args, jax_mesh, hardware=H100,
                              kinds=baseline_kinds(jax_mesh, args))
    return {kind: _case(p, compile_baseline(fn, args, jax_mesh, kind))
            for kind, p in plans.items()}


def _case(plan: autopar.Plan, compiled) -> Case:
    return Case(plan=plan, truth=analyze(compiled), hlo_text=compiled.as_text())

