"""The suite's own markers (tests/conftest.py): the modules marked ``without_megatron``, which .ci/run's
pass with another Megatron-Core leaves out, import no Megatron-Core, directly or through the package;
the lists of slow tests name tests that exist; `-n auto`'s worker count."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import SLOW_MODULES, SLOW_ON_GPU_TESTS, SLOW_TESTS, WITHOUT_MEGATRON_MODULES, pytest_xdist_auto_num_workers

TESTS = Path(__file__).resolve().parent


def test_modules_without_megatron_import_none_of_it():
    assert all((TESTS / name).is_file() for name in WITHOUT_MEGATRON_MODULES)
    modules = sorted(name[:-3] for name in WITHOUT_MEGATRON_MODULES)
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import {', '.join(modules)};"
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:]


def test_a_module_that_imports_megatron_is_caught():
    """The check above can fail: the same code on a module that imports Megatron-Core lists it."""
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_cpu_compat;"
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))[:1])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    assert result.stdout.strip().splitlines()[-1] == "['megatron']", result.stdout[-2000:] + result.stderr[-2000:]


def test_the_slow_lists_name_tests_that_exist():
    sources = {path.name: path.read_text() for path in TESTS.glob("test_*.py")}
    assert SLOW_MODULES <= sources.keys()
    assert all(any(f"def {name}(" in text for text in sources.values()) for name in SLOW_TESTS)
    for entry in SLOW_ON_GPU_TESTS:
        module, name = entry.split("::")
        assert f"def {name}(" in sources.get(module, ""), entry


@pytest.mark.parametrize("gpu, markexpr, workers", [
    (False, "", 5), (False, "not slow", 5), (True, "", 0), (True, "slow", 0), (True, "not slow", 4),
    (True, "not slow and not without_megatron", 4), (True, "not slowest", 0),
])
def test_xdist_workers(monkeypatch, gpu, markexpr, workers):
    """`-n auto`: a worker per core without a GPU; with one, a few for the quick subset only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    config = SimpleNamespace(getoption=lambda name: {"markexpr": markexpr}[name])
    assert pytest_xdist_auto_num_workers(config) == workers
