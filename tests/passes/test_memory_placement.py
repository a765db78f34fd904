"""``cost_model.memory.not_in_outputs`` (XLA:CPU's placement of temporaries in result buffers
not yet written) against a plain reference that keeps, per result buffer, the set of nodes it
is taken at. The model's fast version works on blocks of nodes and bit masks over buffers;
random programs with spans inside one block, across blocks and across many check that both
place every temporary in the same buffer."""

import random

import pytest

from autopar.passes.liveness import _ResultBuffers, not_in_outputs


def reference(spans, outputs):
    """Largest temporary first, into the first result buffer (largest first) big enough, not
    yet written when the temporary dies, and holding nothing else over its life."""
    buffers = sorted(outputs, key=lambda o: -o[1])
    end = max([dies for _, dies, _ in spans] + [made for made, _ in buffers] + [0]) + 1
    taken = [set(range(made, end)) for made, _ in buffers]
    left = []
    for span in sorted(spans, key=lambda s: -s[2]):
        born, dies, nbytes = span
        life = set(range(born, dies + 1))
        for (_, cap), nodes in zip(buffers, taken):
            if nbytes <= cap and not life & nodes:
                nodes |= life
                break
        else:
            left.append(span)
    return left


@pytest.mark.parametrize("seed", range(4))
def test_not_in_outputs_matches_reference(seed):
    rng = random.Random(seed)
    block = _ResultBuffers.BLOCK
    for _ in range(150):
        end = rng.randint(1, 4 * block)
        spans = []
        for _ in range(rng.randint(0, 50)):
            born = rng.randint(0, end)
            life = rng.choice([0, 1, 2, rng.randint(0, block), rng.randint(0, 3 * block)])
            spans.append((born, born + life, rng.choice([1, 2, 4, 8, 16, 100])))
        outputs = [(rng.randint(0, end + 5), rng.choice([1, 4, 8, 16, 64]))
                   for _ in range(rng.randint(0, 70))]
        assert not_in_outputs(spans, outputs) == reference(spans, outputs)


def test_a_temporary_fits_only_a_buffer_written_after_it_dies():
    # one 8-byte result written at node 10: a temporary living to node 9 goes into it, one
    # living to node 10 does not, and a second one over the same nodes finds it taken
    assert not_in_outputs([(2, 9, 8)], [(10, 8)]) == []
    assert not_in_outputs([(2, 10, 8)], [(10, 8)]) == [(2, 10, 8)]
    assert not_in_outputs([(2, 9, 8), (3, 4, 4)], [(10, 8)]) == [(3, 4, 4)]
    # too large for the buffer
    assert not_in_outputs([(2, 9, 16)], [(10, 8)]) == [(2, 9, 16)]
