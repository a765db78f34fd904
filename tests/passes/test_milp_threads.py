"""autopar.passes.highs.solve_milp asks HiGHS for one thread (the same ILP, the same plan), and
still solves when the process's HiGHS thread pool was started with another count."""

import subprocess
import sys

SCRIPT = """
import numpy as np, scipy.optimize, warnings
from autopar.passes.highs import solve_milp
c, A = np.array([1.0, 2.0, 3.0]), np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    scipy.optimize.milp(c, integrality=[1, 1, 1], bounds=scipy.optimize.Bounds(0, 1),
                        constraints=scipy.optimize.LinearConstraint(A, 1, 1),
                        options={"threads": 3})
res, _ = solve_milp(c, A, np.ones(2), np.ones(2), np.ones(3), 10.0)
print(res.status, *[int(v) for v in res.x.round()])
"""


def test_a_thread_pool_started_elsewhere_does_not_stop_the_solve():
    """A fresh process, as the thread pool lives as long as the process."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["0", "0", "1", "0"]


def test_tied_optima_are_broken_alike_and_the_cost_reported_is_the_plain_one():
    """Two equally cheap plans: solve_milp's tie breaks (passes.highs._tie_break) take the same
    one every time, the one they make cheaper, and the cost it reports has no tie break in it."""
    import numpy as np

    from autopar.passes.highs import _tie_break, solve_milp

    c, A = np.array([4.0, 4.0, 9.0]), np.array([[1.0, 1.0, 1.0]])
    picks = set()
    for _ in range(3):
        res, _ = solve_milp(c, A, np.ones(1), np.ones(1), np.ones(3), 10.0)
        picks.add(tuple(int(v) for v in res.x.round()))
        assert res.fun == 4.0
    ties = _tie_break(c)
    assert picks == {(1, 0, 0) if ties[0] < ties[1] else (0, 1, 0)}
    assert 0 < ties.max() <= 1e-7 * 9.0
