"""Compile every Triton kernel of the package for a GPU, on a machine without one.

The ops run on small CPU tensors, choosing what they would choose on the GPU (its block configs,
TMA from sm_90 on), and each kernel launch is replaced by a compile for the target: source to
cubin through ``ptxas``, no launch and no output. Attention runs on a DualKV layout and on a
prefix tree (the forward and dQ kernels' multi-range variants), and against a prompt held apart
(``dualkv_prefix_attn``: its prefix kernels, at the GPU's blocks, with a window and softcap). The
gated delta rule's chunk state scan compiles once, in float32 at Dk = Dv = 128 and chunks of 64; the
short conv's three kernels with the elementwise ops.
A kernel that the GPU would refuse (a type error, an unsupported op, or shared memory over the
block's limit, which a compile does not check and a launch does) fails here in seconds instead of
in a device call. The interpreter that runs the CPU tests does not type-check, and it has no
shared-memory limit.

Use the Triton version of the GPU machine: it is the one that decides. For example:

    pip install --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python tools/check_triton_compile.py    # sm_90, bf16 and fp16, every head dim
    python tools/check_triton_compile.py --head-dims 64 --arch 80    # one head dim, A100

A first run compiles for a few minutes on two cores (Triton caches the results). Float32 cases
take their small blocks without tensor cores, and at head dim 512 minutes each.

Exits 1 if any case fails, naming it and the compiler's message.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Optional

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("check_triton_compile compiles kernels: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from tool_args import comma_names  # noqa: E402  (tools/ is on sys.path when run as a script)

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # an installed or PYTHONPATH package first
from megatron_dualkv import DualKVLayout, PrefixedLayout, TreeLayout  # noqa: E402
from megatron_dualkv.ops import causal_conv1d as conv  # noqa: E402
from megatron_dualkv.ops import chunk_state_scan as scan  # noqa: E402
from megatron_dualkv.ops import dualkv_attn as kernels  # noqa: E402
from megatron_dualkv.ops import dualkv_prefix_attn as prefix  # noqa: E402
from megatron_dualkv.ops.geglu import geglu_func  # noqa: E402
from megatron_dualkv.ops.rms_norm import rms_norm_func  # noqa: E402
from megatron_dualkv.ops.rms_norm_rope import rms_norm_rope_func  # noqa: E402
from megatron_dualkv.ops import row_gather_sum as row_gather  # noqa: E402

HEAD_DIMS = (64, 96, 128, 192, 256, 512)
# the most shared memory one block may take (the CUDA programming guide's per-arch limits)
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# prompt 70 and responses 33, 40: several blocks, none a multiple of a block size
LAYOUT = DualKVLayout(prompt_lens=(70,), response_lens=((33, 40),))
# the same as a prefix tree whose third level sees two ancestor pieces ([0, 70) and the second
# response): the forward and dQ kernels' multi-range variants
TREE = TreeLayout(segment_lens=(70, 33, 40, 21, 9), segment_parent=(-1, 0, 0, 2, 2))
DEPTH_1, LAYOUTS = {"": LAYOUT}, {"": LAYOUT, " tree": TREE}  # label -> layout


class CompileOnlyDriver(DriverBase):
    """Triton's view of a device: only the target to compile for."""

    def __init__(self, target: GPUTarget):
        self.target = target

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("nothing runs: kernels are compiled only")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_instead_of_launch(arch: int) -> list:
    """From now on a launch compiles the kernel for ``sm_<arch>`` and returns; returns the list that
    collects the compiled kernels' names."""
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    compiled, launch = [], JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        limit = SHARED_MEMORY.get(arch)
        if limit is not None and kernel.metadata.shared > limit:
            raise RuntimeError(f"{self.fn.__name__} needs {kernel.metadata.shared} B of shared memory, over "
                               f"sm_{arch}'s {limit}")
        compiled.append(self.fn.__name__)
        return kernel

    JITFunction.run = run
    # what the ops would choose on such a GPU, for the CPU tensors here
    choose_config = kernels.kernel_config
    kernels.kernel_config = prefix.kernel_config = lambda name, head_dim, device, dtype=torch.bfloat16: choose_config(
        name, head_dim, torch.device("cuda"), dtype)
    kernels._has_tma = lambda device: arch >= 90
    row_gather.runs_kernels = lambda x, requested=None: True
    conv.runs_kernels = row_gather.runs_kernels
    scan.triton_available = lambda device: True
    return compiled


def attention_case(head_dim: int, dtype: torch.dtype, window, softcap, deterministic: bool, layout=LAYOUT):
    t = layout.total_tokens
    q = torch.randn(t, 4, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(t, 2, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    out = kernels.dualkv_attn_triton(q, k, v, layout, window_size=window, softcap=softcap, deterministic=deterministic)
    out.float().sum().backward()


def prefix_attention_case(head_dim: int, dtype: torch.dtype, window: Optional[int], softcap: Optional[float]):
    """Responses against their prompt held apart; a window changes the dK/dV pass's blocks."""
    layout = PrefixedLayout((70,), ((33, 40),))
    q = torch.randn(layout.total_tokens, 4, head_dim, dtype=dtype, requires_grad=True)
    k, v, prefix_k, prefix_v = (torch.randn(n, 2, head_dim, dtype=dtype, requires_grad=True)
                                for n in (layout.total_tokens, layout.total_tokens, 70, 70))
    prefix.dualkv_prefix_attn_triton(q, k, v, prefix_k, prefix_v, layout, window_size=window, softcap=softcap).float().sum().backward()


def elementwise_cases(dtype: torch.dtype):
    x = torch.randn(5, 3, 256, dtype=dtype, requires_grad=True)
    weight = torch.randn(256, dtype=dtype, requires_grad=True)
    rms_norm_func(x, weight, 1e-6).float().sum().backward()
    rms_norm_func(x, None, 1e-6, True).float().sum().backward()
    rms_norm_rope_func(x, weight, 1e-6, torch.randn(5, 256)).float().sum().backward()
    geglu_func(torch.randn(5, 2 * 300, dtype=dtype, requires_grad=True)).float().sum().backward()
    row_gather.row_gather_sum(torch.randn(5 * 8, 1100, dtype=dtype), torch.randperm(5 * 8), 8)
    conv_layout = DualKVLayout((9,), ((1, 4, 2),))
    conv_x = torch.randn(conv_layout.total_tokens, 300, dtype=dtype, requires_grad=True)
    for bias in (None, torch.randn(300, dtype=dtype, requires_grad=True)):
        conv.causal_conv1d_func(conv_x, torch.randn(300, 4, dtype=dtype, requires_grad=True), conv_layout, bias,
                                "silu", use_kernel=True).float().sum().backward()


def chunk_state_scan_case():
    """The gated delta rule's state scan at Qwen3.5's head dims and fla's chunk size: float32 only
    (what its caller computes in), whatever --dtypes says."""
    shapes = {"u0": (2, 3, 64, 128), "w": (2, 3, 64, 128), "read_state": (2, 3, 64, 128),
              "attention": (2, 3, 64, 64), "to_end": (2, 3, 64, 128), "chunk_decay": (2, 3), "state": (2, 128, 128)}
    inputs = {name: torch.randn(shape, requires_grad=True) for name, shape in shapes.items()}
    out, final = scan.chunk_state_scan_func(**inputs, backend="triton")
    (out.sum() + final.sum()).backward()


def cases(head_dims, dtypes):
    for d, (name, dtype) in itertools.product(head_dims, dtypes.items()):
        # trees: the variants of the multi-range code (the pieces loop, with a window or without)
        variants = [(None, None, False, LAYOUTS), (16, None, False, LAYOUTS), (None, 30.0, False, DEPTH_1),
                    (None, None, True, DEPTH_1)]
        for window, softcap, deterministic, layouts in variants:
            for kind, layout in layouts.items():
                label = f"attention{kind} D={d} {name}" + (f" window={window}" if window else "") + (
                    f" softcap={softcap}" if softcap else "") + (" deterministic" if deterministic else "")
                yield label, lambda d=d, dt=dtype, w=window, s=softcap, det=deterministic, lay=layout: attention_case(
                    d, dt, w, s, det, lay)
        yield f"attention prefix D={d} {name}", lambda d=d, dt=dtype: prefix_attention_case(d, dt, None, None)
        yield f"attention prefix D={d} {name} window=50 softcap=30.0", lambda d=d, dt=dtype: prefix_attention_case(
            d, dt, 50, 30.0)
    for name, dtype in dtypes.items():
        yield (f"rms_norm, rms_norm_rope, geglu, row_gather_sum, causal_conv1d {name}",
               lambda dt=dtype: elementwise_cases(dt))
    yield "chunk_state_scan fp32 Dk=128 Dv=128 L=64", chunk_state_scan_case


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 (H100/H200), 80 (A100)")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--dtypes", default="bf16,fp16",
                        help=f"comma list of {', '.join(DTYPES)} (fp32 takes minutes per case at head dim 512)")
    args = parser.parse_args()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    dtypes = {name: DTYPES[name] for name in comma_names(parser, "--dtypes", args.dtypes, DTYPES)}
    compiled = compile_instead_of_launch(args.arch)
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    failures = 0
    for label, case in cases(head_dims, dtypes):
        compiled.clear()
        start = time.perf_counter()
        try:
            case()
        except Exception as e:  # noqa: BLE001 - report every failing case, then fail
            failures += 1
            print(f"FAILED {label}: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"ok     {label} ({len(set(compiled))} kernels, {time.perf_counter() - start:.1f} s)", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
