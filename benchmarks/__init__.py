"""autopar's benchmarks: ``python -m benchmarks.run`` (see benchmarks/run.py)."""
