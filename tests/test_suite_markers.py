"""The suite's own markers: the modules marked ``without_megatron`` (tests/conftest.py), which .ci/run's
pass with another Megatron-Core leaves out, import no Megatron-Core, directly or through the package."""
import subprocess
import sys
from pathlib import Path

from conftest import WITHOUT_MEGATRON_MODULES

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
