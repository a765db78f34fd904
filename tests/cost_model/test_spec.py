"""autopar.cost_model.spec.Spec: value semantics, and a hash that is computed once but never pickled."""

import pickle

from autopar.cost_model.spec import Spec


def test_equal_specs_hash_alike_and_a_pickled_spec_carries_no_hash():
    a, b = Spec((("data",), ())), Spec((("data",), ()))
    assert a == b and hash(a) == hash(b) and len({a, b, Spec.replicated(2)}) == 2
    loaded = pickle.loads(pickle.dumps(a))
    # String hashes differ between processes: a hash pickled in one would be wrong in another.
    assert loaded.__dict__ == {"dims": (("data",), ())}
    assert loaded == a and hash(loaded) == hash(a) and repr(loaded) == repr(a)
