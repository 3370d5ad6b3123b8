"""Benchmarks: the length-extrapolation runner, its report, and the ``posenc-bench`` command."""
