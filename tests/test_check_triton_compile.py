"""tools/check_triton_compile.py: the Triton kernels (their depth-1 and multi-range tree variants, the
gated delta rule's state scan, the short conv's) compile for sm_90 on this CPU machine (with the installed Triton), and
a kernel that the compiler refuses is reported as a failed case."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_triton_compile.py"


def check(*args, env=None):
    env = {k: v for k, v in (env or os.environ).items() if k != "TRITON_INTERPRET"}  # the tool compiles
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=600)


def test_kernels_compile_for_hopper():
    result = check("--head-dims", "64", "--dtypes", "bf16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sm_90" in result.stdout and "FAILED" not in result.stdout
    # four attention variants on a DualKV layout, two on a tree, two against a prompt held apart (with a
    # window, whose dK/dV blocks differ, and without), elementwise, the gated delta rule's state scan
    assert result.stdout.count("ok ") == 10
    assert "ok     attention prefix D=64 bf16 (" in result.stdout
    assert "ok     attention tree D=64 bf16 window=16 (" in result.stdout
    assert "ok     attention prefix D=64 bf16 window=50 softcap=30.0 (" in result.stdout
    # each direction of rms_norm, rms_norm_rope and geglu, row_gather_sum, the conv's three
    assert "row_gather_sum, causal_conv1d bf16 (10 kernels" in result.stdout
    assert "ok     chunk_state_scan fp32 Dk=128 Dv=128 L=64 (2 kernels" in result.stdout


def test_a_kernel_the_compiler_refuses_fails_its_case(tmp_path):
    """The tool's own check can fail: a copy of the package whose GeGLU kernel makes a block of 3."""
    package = Path(__file__).resolve().parents[1] / "megatron_dualkv"
    broken = tmp_path / "megatron_dualkv"
    shutil.copytree(package, broken)
    geglu = broken / "ops" / "geglu.py"
    source = geglu.read_text()
    line = "    row = tl.program_id(0).to(tl.int64)"
    if line not in source:
        pytest.skip("the GeGLU kernel changed: pick another line to break")
    geglu.write_text(source.replace(line, line + "\n    row = tl.zeros([3], tl.int64) + row  # not a power of two", 1))
    result = check("--head-dims", "64", "--dtypes", "bf16",
                   env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert result.returncode == 1
    assert "FAILED rms_norm, rms_norm_rope, geglu, row_gather_sum, causal_conv1d bf16: CompilationError" in result.stdout
