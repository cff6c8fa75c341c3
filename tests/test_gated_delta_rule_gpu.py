"""The chunked gated delta rule run once per tree level (``ops.gated_delta_rule``) on a GPU, fla's
Triton kernel, the PyTorch one (``torch_chunk_varlen``) and the PyTorch one with the Triton state
scan (``ops.chunk_state_scan``, backend "triton"): on the packed layout in bf16, each
trajectory's outputs and every input gradient within 2x the error that the same backend makes on
the replicated layout (each trajectory a sequence from zero state), both measured against the
float64 reference recurrence; and, since a kernel bug would show on both layouts alike, within a
few bf16 roundings of the float64 result outright."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from megatron_dualkv.layout import DualKVLayout, TreeLayout
from megatron_dualkv.ops.gated_delta_rule import fla_installed, fla_usable, gated_delta_rule_func
from flash_check import assert_within_twice_the_reference_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fla_runs_here():
    if not (torch.cuda.is_available() and fla_installed()):
        return False
    import triton

    return fla_usable(torch.cuda.get_device_capability(), triton.__version__,
                      importlib.util.find_spec("tilelang") is not None)


BACKENDS = [
    pytest.param("fla", marks=pytest.mark.skipif(not _fla_runs_here(), reason="needs fla, usable on this GPU")),
    "torch",
    "triton",
]

# bf16 keeps 8 significant bits (0.4%); the chunked kernel rounds its inputs and intermediates, so a
# few of those, not the O(1) of a wrong gradient
BF16_TOLERANCE = 0.05
LAYOUTS = [
    DualKVLayout((300,), ((100, 77, 129, 64),)),
    DualKVLayout((130, 70), ((50, 65), (33,)), pad_len=5),
    TreeLayout((200, 64, 40, 90, 30, 17), (-1, 0, 1, 0, 3, -1)),
]


def _trajectories(layout):
    """Packed indices of every root-to-leaf path."""
    paths = []
    for node in layout.nodes:
        if node.subtree_end == node.start + node.length:
            index = [t for start, length in node.ancestors for t in range(start, start + length)]
            paths.append(torch.tensor(index + list(range(node.start, node.start + node.length)), device="cuda"))
    return paths


def _inputs(tokens, heads, value_heads, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(tokens, heads, d, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(tokens, value_heads, d, device="cuda", generator=gen)
    g = F.logsigmoid(torch.randn(tokens, value_heads, device="cuda", generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(tokens, value_heads, device="cuda", generator=gen))
    return q, k, v, g, beta


def _trajectory_outputs_and_grads(inputs, layout, paths, douts, dtype, backend, replicated):
    """Every trajectory's outputs (concatenated) and the gradients of sum(douts * outputs) with
    respect to the packed inputs; ``replicated``: run each trajectory alone as its own sequence."""
    leaves = [t.to(dtype if i < 3 else (torch.float64 if dtype == torch.float64 else torch.float32))
              .detach().requires_grad_() for i, t in enumerate(inputs)]
    if replicated:
        lengths = tuple(len(p) for p in paths)
        index = torch.cat(paths)
        out, _ = gated_delta_rule_func(*(t.index_select(0, index) for t in leaves),
                                       TreeLayout(lengths, (-1,) * len(lengths)).to("cuda"), qk_l2norm=True,
                                       backend=backend)
    else:
        packed, _ = gated_delta_rule_func(*leaves, layout.to("cuda"), qk_l2norm=True, backend=backend)
        out = torch.cat([packed.index_select(0, p) for p in paths])
    return (out, *torch.autograd.grad(out, leaves, douts.to(out.dtype)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["group", "groups-padded", "tree"])
# (16, 32): Qwen3.5-4B's, so that after the model has run fla's tuned configs are found in its cache
@pytest.mark.parametrize("heads, value_heads", [(2, 2), (2, 4), (16, 32)])
def test_levels_within_twice_the_replicated_error(layout, heads, value_heads, backend):
    inputs = _inputs(layout.total_tokens, heads, value_heads, 128, seed=heads + value_heads)
    paths = _trajectories(layout)
    douts = torch.randn(sum(len(p) for p in paths), value_heads, 128, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(7))
    exact = _trajectory_outputs_and_grads(inputs, layout, paths, douts, torch.float64, "reference", False)
    ours = _trajectory_outputs_and_grads(inputs, layout, paths, douts, torch.bfloat16, backend, False)
    replicated = _trajectory_outputs_and_grads(inputs, layout, paths, douts, torch.bfloat16, backend, True)
    for name, a, b, e in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), ours, replicated, exact):
        assert torch.isfinite(a).all(), name
        assert_within_twice_the_reference_error(name, a, b, e, eps=1e-3)
        error, size = (a.double() - e).abs().max().item(), e.abs().max().item()
        assert error <= BF16_TOLERANCE * size, f"{name}: {error:.3e} against a largest value of {size:.3e}"
