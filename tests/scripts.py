"""A script of ``benchmarks/`` imported as a module for a test, and removed from ``sys.modules`` after it."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_script(filename: str, module_name: str):
    """``benchmarks/<filename>`` imported as ``module_name`` for the ``with`` block."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(module_name, None)
