"""Benchmark scripts (run as files: ``python benchmarks/<script>.py``) and the two modules they share,
:mod:`benchmarks.common` and :mod:`benchmarks.stats`. Not installed with the package."""
