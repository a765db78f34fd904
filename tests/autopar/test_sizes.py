"""``autopar._sizes``: sizes as ``memory_budget`` and ``--memory-budget`` take them, and
sizes, times and flops as the report prints them."""

import pytest

from autopar._sizes import format_bytes, format_flops, format_seconds, parse_bytes


@pytest.mark.parametrize("text, nbytes", [
    ("40GiB", 40 * 2**30), ("512 mib", 512 * 2**20), ("64GB", 64 * 10**9),
    ("1.5TiB", int(1.5 * 2**40)), ("1024", 1024), ("2kb", 2000), (" 3 B ", 3),
    ("1e9", 10**9), ("2.5E3KiB", 2500 * 2**10), ("1e+3", 1000)])
def test_sizes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["x", "12x", "-1GiB", "GiB", "", "e9", "4 GiB B"])
def test_what_is_not_a_size_says_what_to_write(text):
    with pytest.raises(ValueError, match="is not a size: give bytes or a number with a unit"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0", "0.1", "1e-3", "0GiB"])
def test_a_size_under_one_byte_is_refused_as_such(text):
    with pytest.raises(ValueError, match="is less than one byte: give a positive size"):
        parse_bytes(text)


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (10 * 1024, "10.0 KiB"),
                                     (2.7 * 2**20, "2.7 MiB"), (1.5 * 2**30, "1.50 GiB"),
                                     (72e9, "67.1 GiB")])
def test_sizes_print_in_the_unit_that_fits(n, text):
    assert format_bytes(n) == text


def test_seconds_and_flops_print_in_the_unit_that_fits():
    assert [format_seconds(t) for t in (26.9e-6, 1.263e-3, 2.5)] == ["26.9 us", "1.263 ms",
                                                                     "2.500 s"]
    assert [format_flops(n) for n in (4.578e7, 2.761e11, 500)] == ["45.8 MFLOP", "276 GFLOP",
                                                                   "500 FLOP"]
