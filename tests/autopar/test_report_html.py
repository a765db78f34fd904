"""The report, per layer and beside baselines, as text and as a self-contained HTML page."""

from html.parser import HTMLParser

import pytest

import autopar
from autopar._html import render_html
from autopar._layers import layer_rows
from autopar._compare import predict_baselines
from autopar.models import gpt

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def planned():
    fn, args = gpt.make_train_step(gpt.TINY)
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


def test_text_report_shows_baselines_and_layers(planned):
    plan, baselines = planned
    text = plan.report(baselines)
    assert "Beside hand-written baselines" in text and "fsdp" in text and "Per layer" in text
    assert "['block_0']['qkv']['kernel']" in text


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


def test_html_is_self_contained_and_balanced(planned):
    plan, baselines = planned
    page = render_html(plan, baselines)
    checker = _Checker()
    checker.feed(page)
    assert checker.stack == [] and checker.external == []
    assert page.count("<svg") == 2 and "block_1" in page and "dp" in page
    assert "Other inputs and outputs" in page and "tokens" in page  # the batch's sharding
