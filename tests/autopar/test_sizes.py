"""``autopar._sizes.parse_bytes``: sizes as ``memory_budget`` and ``--memory-budget`` take
them."""

import pytest

from autopar._sizes import parse_bytes


@pytest.mark.parametrize("text, nbytes", [
    ("40GiB", 40 * 2**30), ("512 mib", 512 * 2**20), ("64GB", 64 * 10**9),
    ("1.5TiB", int(1.5 * 2**40)), ("1024", 1024), ("2kb", 2000), (" 3 B ", 3),
    ("1e9", 10**9), ("2.5E3KiB", 2500 * 2**10), ("1e+3", 1000)])
def test_sizes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["0", "x", "12x", "-1GiB", "GiB", "0.1", "", "1e-3", "e9",
                                  "4 GiB B"])
def test_what_is_not_a_size_says_what_to_write(text):
    with pytest.raises(ValueError, match="is not a size: give bytes or a number with a unit"):
        parse_bytes(text)


@pytest.mark.parametrize("nbytes, text", [
    (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (100 * 2**10, "100.0 KiB"),
    (int(2.7 * 2**20), "2.70 MiB"), (67 * 2**30, "67.0 GiB"), (2**41, "2.00 TiB")])
def test_sizes_print_in_the_unit_that_fits(nbytes, text):
    from autopar._sizes import format_bytes
    assert format_bytes(nbytes) == text
