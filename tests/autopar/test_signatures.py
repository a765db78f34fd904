"""The public signatures: no private parameters, and one hardware default (None: this
backend's profile) in plan, parallelize, compare and the CLI's report."""

import inspect

import autopar
from autopar import cli


def test_no_private_parameters_in_public_signatures():
    for fn in (autopar.plan, autopar.parallelize, autopar.compare):
        private = [p for p in inspect.signature(fn).parameters if p.startswith("_")]
        assert not private, (fn.__name__, private)


def test_one_hardware_default():
    assert inspect.signature(autopar.plan).parameters["hardware"].default is None
    assert inspect.signature(autopar.compare).parameters["hardware"].default is None
    report = cli.build_parser().parse_args(["report", "x.py:f", "--mesh", "data=8"])
    assert report.hardware is None
