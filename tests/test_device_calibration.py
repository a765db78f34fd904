"""The timeline model against a real GPU: seven train steps compiled and traced on an H200
(``benchmarks/results/device_h200``, from ``python -m benchmarks.device_step --trace``), each
compiled program simulated with the current cost model on the ``h200`` profile."""

import os

import pytest

from benchmarks.device_step import compare

FOLDER = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "device_h200")


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in compare(FOLDER)}


def test_every_traced_workload_is_compared(rows):
    assert set(rows) == {"gpt", "gpt-scan", "gpt-wide", "bert", "llama", "moe", "mlp"}


@pytest.mark.parametrize("name", ["gpt", "gpt-scan", "gpt-wide", "llama", "moe", "mlp"])
def test_simulated_step_is_near_the_traced_one(rows, name):
    r = rows[name]
    # kernels' span on the device; the model under-prices memory-bound attention fusions
    assert 0.8 <= r.simulated_s / r.span_s <= 1.1
    # the matmul kernels, priced at the profile's efficiency (TF32 for float32 dots)
    assert 0.9 <= r.simulated_matmul_s / r.matmul_kernels_s <= 1.1


def test_bert_gap_is_its_repeated_index_scatter(rows):
    # 15% of BERT's tokens are [MASK]: the embedding gradient's scatter-add serializes on them.
    # The roofline cannot see index values; without that kernel the step is priced as the rest.
    r = rows["bert"]
    kernel, traced_s, simulated_s = r.slowest_other
    assert "scatter" in kernel and traced_s > 0.5 * r.span_s
    assert 0.8 <= (r.simulated_s - simulated_s) / (r.span_s - traced_s) <= 1.1


def test_a_run_on_this_machine_can_be_compared(tmp_path):
    # the tiny MLP on the CPU: the same path a GPU session runs, down to the trace it reads
    from benchmarks import device_step
    assert device_step.main(["--tiny", "--only", "mlp", "--warmup", "1", "--repeats", "2",
                             "--trace", "--out", str(tmp_path)]) == 0
    (row,) = compare(str(tmp_path))
    assert row.name == "mlp" and row.measured_s > 0 and row.span_s > 0
    assert row.simulated_s > 0 and row.matmul_kernels_s + row.other_kernels_s > 0
