"""Sharding specs: which mesh axes split which tensor dimension.

A :class:`Spec` holds, for every dimension of a tensor, the tuple of mesh axes that split it,
major to minor (the axes of one dimension are always kept in mesh order). It prints in the
compact DTensor-like notation used in tests and reports: ``S(data)R`` is a matrix whose rows are
split over ``data`` and whose columns are replicated; ``S(data,model)`` splits one dimension over
both axes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jax.sharding import PartitionSpec

#: dims -> its Spec (see :class:`Spec`).
_SPECS: dict[tuple, Spec] = {}


@dataclass(frozen=True, eq=False)
class Spec:
    """One object per ``dims``: ``Spec(dims)`` returns the one already made. Specs key the
    planner's memos and caches, millions of lookups on a deep model, so they compare and hash
    by identity, in C, rather than by their nested tuples (on the unrolled 96-layer GPT the
    tuple-based hash and equality were 0.7 s of its planning, profiled)."""

    dims: tuple[tuple[str, ...], ...]

    def __new__(cls, dims):
        spec = _SPECS.get(dims)
        if spec is None:
            spec = _SPECS.setdefault(dims, super().__new__(cls))
        return spec

    def __reduce__(self):
        return Spec, (self.dims,)  # unpickled through __new__: the one Spec of its dims

    @staticmethod
    @functools.cache
    def replicated(rank: int) -> Spec:
        return Spec(((),) * rank)

    @staticmethod
    def from_partition_spec(pspec: PartitionSpec | None, rank: int) -> Spec:
        entries = tuple(pspec or ())
        if len(entries) > rank:
            raise ValueError(f"PartitionSpec {pspec} has more entries than the rank {rank}")
        dims = []
        for entry in entries + (None,) * (rank - len(entries)):
            if entry is None:
                dims.append(())
            elif isinstance(entry, str):
                dims.append((entry,))
            else:
                dims.append(tuple(entry))
        return Spec(tuple(dims))

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    def place_of(self, axis: str) -> tuple[int, tuple[str, ...]] | None:
        """Where ``axis`` splits: (its dim, the axes before it in that dim), or None. Two specs
        with ``axis`` in one dim after different axes give each device different blocks of
        that dim (``S(model)`` and ``S(data,model)``), so moving between them is not free."""
        for d, names in enumerate(self.dims):
            if axis in names:
                return d, names[:names.index(axis)]
        return None

    def shards(self, dim: int, axis_sizes: dict[str, int]) -> int:
        return math.prod(axis_sizes[a] for a in self.dims[dim])

    def local_shape(self, shape: tuple[int, ...], axis_sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(s // self.shards(d, axis_sizes) for d, s in enumerate(shape))

    def to_partition_spec(self) -> PartitionSpec:
        entries = [None if not d else (d[0] if len(d) == 1 else d) for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def __str__(self) -> str:
        if not self.dims:
            return "R()"
        return "".join(f"S({','.join(d)})" if d else "R" for d in self.dims)


def pspec_text(pspec: PartitionSpec) -> str:
    """A PartitionSpec as code a user writes, ``P('data', None)`` (jax's own repr varies by
    version: ``P('data',)``)."""
    return "P(" + ", ".join(repr(e) for e in pspec) + ")"


def spec_fits(spec: Spec, shape: tuple[int, ...], axis_sizes: dict[str, int]) -> bool:
    """Whether every split dimension divides evenly by the product of its axes."""
    return all(s % spec.shards(d, axis_sizes) == 0 for d, s in enumerate(shape))


def local_bytes(spec: Spec, shape, itemsize: int, axis_sizes: dict[str, int]) -> int:
    """The bytes of one device's block: ``spec.local_shape``'s product times ``itemsize``
    (written out: the memory model calls it for every value and strategy)."""
    nbytes = itemsize
    for size, axes in zip(shape, spec.dims, strict=True):  # a spec names every dim
        for axis in axes:
            size //= axis_sizes[axis]
        nbytes *= size
    return nbytes
