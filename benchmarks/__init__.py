"""omni_trio's developer benchmarks: figures against peers measured in the same run.

Run from the repository root with ``python -m benchmarks NAME``. They are not part
of the installed package: they compare the engine with other ways of serving a
pipeline and regenerate ``docs/performance.md``.
"""
