"""Fixtures of the benchmark tests: the standalone scripts of bench/, loaded as modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def bench_script():
    """`bench_script("gpu_selfcheck")`: bench/gpu_selfcheck.py as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
