"""The report, per layer and beside baselines, as text and as a self-contained HTML page."""

import dataclasses
import re
from html.parser import HTMLParser

import pytest

import autopar
from autopar._html import render_html
from autopar._charts import memory_chart
from autopar._layers import OTHER, Phase, layer_rows
from autopar._compare import predict_baselines
from autopar.models import gpt, targets

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def planned():
    # Tiny widths, but enough tokens that sharding pays on an H100 (at gpt.TINY's 16 x 16
    # tokens the fastest plan is replicated: no collective costs less than its latency).
    fn, args = gpt.make_train_step(dataclasses.replace(gpt.TINY, batch=64, seq=128))
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    return plan, predict_baselines(fn, args, MESH, hardware="h100")


def test_layers_split_the_estimate(planned):
    plan, _ = planned
    rows = layer_rows(plan)
    assert [r.name for r in rows][:2] == ["block_0", "block_1"] and rows[-1].name == "other"
    assert sum(r.compute_s for r in rows) == pytest.approx(plan.estimate.compute_time_s)
    assert sum(r.comm_s for r in rows) == pytest.approx(plan.estimate.comm_time_s)
    # blocks 0 and 1 are the same layer: the same number of parameters and the same bytes
    assert len(rows[0].params) == len(rows[1].params) == 12
    assert rows[0].state_bytes == rows[1].state_bytes > 0
    kernel = next(p for p in rows[0].params if p.path.endswith("['mlp_in']['kernel']"))
    assert kernel.shape == (gpt.TINY.hidden, 4 * gpt.TINY.hidden)


def test_little_time_is_left_outside_the_layers():
    """The tied logits (``embed.attend``), the embedding's gather and gradient scatter and the
    optimizer's updates count in their layers, the loss in its own row: what is left is
    under 5% of the step of the bundled GPT at realistic widths (planned from shapes;
    nothing compiles)."""
    fn, args = targets.gpt_realistic()
    plan = autopar.plan(fn, *args, mesh=MESH, hardware="h100")
    rows = {r.name: r for r in layer_rows(plan)}
    total = plan.estimate.compute_time_s + plan.estimate.comm_time_s
    assert rows[OTHER].compute_s + rows[OTHER].comm_s < 0.05 * total
    assert rows["embed"].compute_s > 0.1 * total   # the logits' matmuls


def test_text_report_shows_baselines_and_layers(planned):
    plan, baselines = planned
    text = plan.report(baselines)
    assert "Beside hand-written baselines" in text and "fsdp" in text and "Per layer" in text
    assert "['block_0']['qkv']['kernel']" in text
    assert text.split("\n")[2] == "The plan in words:"
    assert re.search(r"\['block_0'\]\['mlp_in'\]\['kernel'\]\s+\[64,256\]", text)  # its shape
    collectives = text.split("Collectives chosen")[1]
    assert "transpose(" not in collectives and "backward of block_*/mlp_in" in collectives
    assert re.search(r"all-reduce over [a-z,]+ \(groups of [248]\): \d+ per step", collectives)


def test_report_names_the_default_hardware():
    fn, args = gpt.make_train_step(gpt.TINY)
    plan = autopar.plan(fn, *args, mesh=MESH, search=False)
    assert "(the default, this backend's" in plan.report().splitlines()[0]


class _Checker(HTMLParser):
    VOID = frozenset({"meta", "br", "img", "input", "link", "hr", "polyline", "polygon", "line",
                      "rect"})

    def __init__(self):
        super().__init__()
        self.stack, self.external = [], []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("src", "href") and v and not v.startswith("#"):
                self.external.append(v)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, (self.stack[-3:], tag)
        self.stack.pop()


def _balanced(page: str) -> None:
    checker = _Checker()
    checker.feed(page)
    assert checker.stack == [] and checker.external == []


def test_html_is_self_contained_and_balanced(planned):
    plan, baselines = planned
    page = render_html(plan, baselines)
    _balanced(page)
    # time per layer, candidates, mesh, memory
    assert page.count("<svg") == 4 and "block_1" in page and "dp" in page
    assert "Other inputs and outputs" in page and "tokens" in page  # the batch's sharding
    assert "The plan in words" in page and "Plans the planner compared" in page
    assert "forward" in page and "optimizer" in page and "live at the predicted peak" in page
    assert "[64,256]" in page   # a kernel's shape


def test_css_is_scoped_and_notebooks_get_a_fragment(planned):
    plan, _ = planned
    page = plan.to_html()
    css = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    selectors = [rule.split("{")[0] for rule in css.split("}") if "{" in rule]
    for selector in selectors:
        for part in selector.split(","):
            assert part.strip().startswith(".autopar-report"), part
    fragment = plan._repr_html_()
    assert fragment.startswith('<div class="autopar-report">') and "<html" not in fragment
    _balanced(fragment)


def test_memory_chart_phase_names_never_overlap():
    # a pipeline region's forward and backward alternate in a few operations
    f, b, o = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER
    phases = [f] * 80 + [b] * 4 + [f] * 3 + [b] * 4 + [o] * 300
    svg = memory_chart(10, [1] * len(phases), phases, 5)
    names = [(float(x), len(s)) for x, s in re.findall(
        r'<text x="([\d.]+)" y="16.0" font-size="11" text-anchor="middle"[^>]*>(\w+)</text>', svg)]
    assert len(names) >= 3, svg   # forward, backward, optimizer at least
    spans = sorted((x - 3.3 * n, x + 3.3 * n) for x, n in names)
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
