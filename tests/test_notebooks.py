"""Every notebook in examples/ executes top to bottom on 8 simulated CPU devices (nbclient)
that it asks for itself, with no XLA_FLAGS set beforehand (as on a fresh Colab runtime), and
is stored with its outputs cleared."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "examples", "*.ipynb")))


def _outputs(nb, output_type):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == output_type]


def test_there_are_notebooks():
    names = {os.path.basename(p) for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "gpt_walkthrough.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, cell.source[:80]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    # The kernel inherits this environment, without the tests' simulated devices.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": ROOT}}).execute()
    assert not _outputs(nb, "error")
    shown = "".join(str(o.get("data", {}).get("text/markdown", ""))
                    for o in _outputs(nb, "display_data"))
    assert "no accelerator: falling back to 8 simulated CPU devices" in shown, shown
    text = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
    assert "autopar plan on mesh data=2 x model=4" in text
    assert "autopar " in text and "dp " in text and "fsdp " in text  # the comparison table
    images = [o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) >= 2, "the loss curve and the comparison chart"
    html = [o for o in _outputs(nb, "display_data") if "text/html" in o.get("data", {})]
    assert any("<svg" in o["data"]["text/html"] for o in html), "the per-layer chart"
