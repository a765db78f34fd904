"""The README: short, opening with the two commands, and its quickstart's sample output real.

The quickstart's code (between ``<!-- quickstart -->`` and ``<!-- /quickstart -->``) runs in a
subprocess on 8 simulated CPU devices, and what it prints must equal the README's sample block
(between ``<!-- sample: quickstart -->`` and ``<!-- /sample -->``).

Refresh the sample after a change that alters the output::

    python tests/test_readme.py --write
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

MAX_LINES = 200
#: The README must open with these (CI and reviewers run them as written).
OPENING_COMMANDS = ('pip install -e . && autopar demo', 'pip install -e ".[test]" && pytest')

CODE_START, CODE_END = "<!-- quickstart -->", "<!-- /quickstart -->"
SAMPLE_START, SAMPLE_END = "<!-- sample: quickstart -->", "<!-- /sample -->"
QUICKSTART_TIMEOUT_S = 300


def _between(text: str, start: str, end: str) -> str:
    """The text between the only ``start`` marker and the ``end`` marker after it."""
    assert text.count(start) == 1, f"README must hold {start!r} exactly once"
    _, rest = text.split(start)
    assert end in rest, f"README: {start!r} has no {end!r} after it"
    return rest.split(end, 1)[0]


def _fenced(block: str) -> str:
    """The body of the one fenced code block in ``block`` (the fences and the language tag
    dropped)."""
    lines = block.strip("\n").splitlines()
    assert lines and lines[0].startswith("```") and lines[-1] == "```", (
        f"expected one fenced code block, got:\n{block}")
    return "\n".join(lines[1:-1]) + "\n"


def quickstart_code(text: str) -> str:
    return _fenced(_between(text, CODE_START, CODE_END))


def sample_output(text: str) -> str:
    return _fenced(_between(text, SAMPLE_START, SAMPLE_END))


def run_quickstart(code: str) -> str:
    """What ``code`` prints, run from the repository root with the repository first on the
    path (as a user runs it beside an editable install), on the CPU with no ``XLA_FLAGS``:
    the code asks for its own simulated devices, as a user's fresh process does."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=QUICKSTART_TIMEOUT_S)
    assert done.returncode == 0, f"the README's quickstart failed:\n{done.stderr}"
    return done.stdout


def test_readme_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0] == "# autopar"
    fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert all(not line.strip() for line in lines[1:fence]), "text before the commands"
    first = lines[fence + 1:fence + 1 + len(OPENING_COMMANDS)]
    for line, command in zip(first, OPENING_COMMANDS, strict=True):
        assert line == command or line.startswith(command + " "), (line, command)


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES} (details go in docs/)"


def test_quickstart_prints_the_sample():
    text = README.read_text()
    printed = run_quickstart(quickstart_code(text))
    assert printed == sample_output(text), (
        "the README's sample differs from what its quickstart prints; if the change is "
        f"intended, run `python tests/test_readme.py --write`.\nprinted:\n{printed}")


def write_sample() -> None:
    """Run the quickstart and put what it prints into the README's sample block."""
    text = README.read_text()
    printed = run_quickstart(quickstart_code(text))
    old = _between(text, SAMPLE_START, SAMPLE_END)
    README.write_text(text.replace(SAMPLE_START + old, f"{SAMPLE_START}\n```\n{printed}```\n", 1))
    print(printed, end="")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_readme.py --write   (refresh the README's sample)")
    write_sample()
