"""The docs site (mkdocs.yml) builds with warnings as errors, and its API reference carries
every public function, class and error from the docstrings. Needs the `docs` extra, which the
`test` extra includes."""

import html
import os
import re
import subprocess
import sys

import pytest

import autopar

pytest.importorskip("mkdocstrings", reason="the docs extra: pip install -e '.[docs]'")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_site_builds_strict_with_the_api_reference(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "api" / "index.html").read_text()
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    public = [n for n in autopar.__all__] if hasattr(autopar, "__all__") else [
        n for n in dir(autopar) if not n.startswith("_") and n not in ("baselines",)]
    for name in ("plan", "parallelize", "Plan", "Pipeline", "value_and_grad", "grad",
                 "compare", "profile", "simulate_cpu_devices"):
        assert f"autopar.{name}" in text or f" {name}(" in text, name
    errors = [n for n in public if isinstance(getattr(autopar, n), type)
              and issubclass(getattr(autopar, n), (autopar.AutoparError,
                                                   autopar.AutoparWarning))]
    missing = [n for n in errors if n not in text]
    assert not missing, missing
    assert "batch_axes" in text and "Args:" not in text  # the docstrings were parsed
