"""Pass 8, overlap: strategies whose communication hides behind their own compute.

``collective_matmul`` adds them to the dot nodes' strategies (priced by
``cost_model.overlap``); ``regions`` emits them (importing it registers the emitters in
``passes.emit.REWRITES``).
"""

from autopar.passes.overlap import regions as regions
from autopar.passes.overlap.collective_matmul import (
    with_collective_matmuls as with_collective_matmuls)
