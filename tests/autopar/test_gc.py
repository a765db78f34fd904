"""autopar._gc: the objects made while the collector was paused go to its oldest generation
when it resumes (no collection walks them then), a program's frozen objects stay frozen, and
cycles made during the pause are still collected."""

import gc
import weakref

from autopar._gc import paused_gc


class _Node:
    def __init__(self):
        self.other = None


def _in_generation(obj, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def test_objects_made_while_paused_go_to_the_oldest_generation():
    for _ in range(2):  # every pause, not only a process's first (on 3.12 the first hand-over
        with paused_gc():  # unfreezes the objects the interpreter froze at start)
            made = [_Node() for _ in range(1000)]
            assert _in_generation(made[0], 0)
        assert not _in_generation(made[0], 0) and _in_generation(made[0], 2)
        assert gc.isenabled()


def test_a_programs_frozen_objects_stay_frozen():
    # A collection resets the allocation counts, so no automatic one (which a long test
    # process may be due for) moves `made` out of the youngest generation before it is seen.
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with paused_gc():
            made = _Node()
        assert gc.get_freeze_count() == frozen and _in_generation(made, 0)
    finally:
        gc.unfreeze()


def test_cycles_made_while_paused_are_collected_after():
    with paused_gc():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None
    gc.collect()
    assert gone() is None
