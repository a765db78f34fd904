"""Pass 8, overlap: strategies whose communication hides behind their own compute.

``collective_matmul`` adds them to the dot nodes' strategies and ``prefetch`` to the scanned
inputs' (priced by ``cost_model.overlap``); ``regions`` emits the collective matmuls
(``passes.emit``'s ``emit_scan`` the prefetches) (importing it registers the emitters in
``passes.emit.REWRITES``).
"""

from autopar.passes.overlap import regions as regions
from autopar.passes.overlap.collective_matmul import (
    with_collective_matmuls as with_collective_matmuls)
from autopar.passes.overlap.prefetch import with_prefetch as with_prefetch
