"""issue #26's choice: a scanned GPT of about 26B parameters, global batch 8 x 1024 tokens.

Over two nodes (``{"node": 2, "gpu": 8}``, ``node`` on InfiniBand, 16 simulated devices, run
as a user runs the benchmark: ``python -m benchmarks.run --suite pipeline``), the program
``pipeline="auto"`` chooses beats every hand-written plan that fits in memory, priced from
the compiled HLO on the h100 profile's link levels, with the collectives moved at the
program's dtypes as a GPU moves them and as XLA:CPU widened them; of its two candidates,
pipelined over ``node`` and not pipelined, it keeps the one whose compiled program is faster.
Inside one node it does not pipeline."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from benchmarks import pipeline as bench
from tests.compile_cache import cache_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_node(tmp_path_factory):
    """The benchmark's two-node row, run as a user runs it."""
    out = tmp_path_factory.mktemp("pipeline")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **cache_env(out / "compiled")}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "pipeline",
                           "--cases", "two-node", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| two-node | autopar |" in (out / "pipeline.md").read_text()
    (row,) = json.loads((out / "pipeline.json").read_text())
    return row


def _other_candidate(row) -> str:
    """The program of the candidate ``auto`` did not keep."""
    return ("autopar (no pipeline)" if row["pipeline"] is not None
            else "autopar (pipelined over node)")


def test_auto_beats_every_hand_written_plan_that_fits(two_node):
    row = two_node
    assert {"none", "node"} <= set(row["pipeline_search"]), row["pipeline_search"]
    if row["pipeline"] is not None:
        assert row["pipeline"]["bubble_fraction"] == row["bubble_formula"]
    programs = dict(row["programs"])
    mine = programs.pop("autopar")
    assert mine["fits"]
    assert set(programs) >= {_other_candidate(row), "dp(node)+fsdp(gpu)",
                             "dp(node)+megatron(gpu)", "fsdp(all)"}
    # the other candidate is beaten on the reading `auto` chooses by (the test below); the
    # two readings can rank the two candidates differently
    for name, other in programs.items():
        if other["fits"] and name != _other_candidate(row):
            assert mine["step_time_s"] < other["step_time_s"], name
            assert mine["step_program_dtypes_s"] < other["step_program_dtypes_s"], name


def test_auto_takes_the_faster_of_pipelining_over_the_slow_axis_or_not(two_node):
    """The candidate whose compiled program simulates faster (collectives at bf16) is kept,
    pipelined over ``node`` or not (which one is in ``docs/pipeline.md``)."""
    row = two_node
    compiled = row["pipeline_search_compiled"]
    faster = min(compiled, key=compiled.get)
    assert (None if row["pipeline"] is None else row["pipeline"]["axis"]) == (
        None if faster == "none" else faster), compiled
    programs = row["programs"]
    assert programs["autopar"]["step_program_dtypes_s"] == pytest.approx(compiled[faster])
    other = programs[_other_candidate(row)]
    assert other["fits"]
    assert programs["autopar"]["step_program_dtypes_s"] < other["step_program_dtypes_s"]


def test_inside_one_node_auto_does_not_pipeline():
    fn, args = bench.train_step_and_args()
    with pytest.warns(autopar.MemoryBudgetWarning):   # 26B does not fit 8 H100s any way
        plan = autopar.plan(fn, *args, mesh=bench.make_mesh(bench.CASES["one-node"][0]),
                            hardware="h100", pipeline="auto", verbose=False)
    assert plan.pipeline is None
    assert plan.stats["loss_marked"]
    # nothing fits, so stages over each axis were tried too, and were slower, predicted and
    # compiled
    for search in (plan.stats["pipeline_search"], plan.stats["pipeline_search_compiled"]):
        assert set(search) == {"none", "data", "model"}
        assert all(search["none"] < t for k, t in search.items() if k != "none")
