"""``autopar._sizes.parse_bytes``: sizes as ``memory_budget`` and ``--memory-budget`` take
them."""

import pytest

from autopar._sizes import parse_bytes


@pytest.mark.parametrize("text, nbytes", [
    ("40GiB", 40 * 2**30), ("512 mib", 512 * 2**20), ("64GB", 64 * 10**9),
    ("1.5TiB", int(1.5 * 2**40)), ("1024", 1024), ("2kb", 2000), (" 3 B ", 3)])
def test_sizes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["0", "x", "12x", "-1GiB", "GiB", "0.1", "", "1e9", "4 GiB B"])
def test_what_is_not_a_size_says_what_to_write(text):
    with pytest.raises(ValueError, match="is not a size: give bytes or a number with a unit"):
        parse_bytes(text)
