"""Benchmarks: ``python -m omni_trio.bench NAME``, figures against peers in the same run."""
