"""Triton DualKV kernels on a GPU: bf16/fp16 outputs and gradients within 2x the error of the
same-precision PyTorch reference (flash-attention style), fuzzed layouts and prefix trees, determinism."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, TreeLayout, pack_groups, pack_trajectories
from flash_check import check_flash_style, grads
from strategies import rollout_groups, trajectory_sets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_deterministic_gradients_are_bitwise_equal():
    layout = DualKVLayout((3000,), ((500,) * 8,)).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(layout.total_tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (16, 4, 4))
    dout = torch.randn_like(q)
    first = grads(layout, q, k, v, dout, "triton", deterministic=True)
    second = grads(layout, q, k, v, dout, "triton", deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@given(
    rollout_groups(max_groups=4, max_prompt=700, max_responses=6, max_response=300),
    st.sampled_from([(8, 2), (4, 4), (6, 1)]),
    st.sampled_from([64, 128]),
    st.sampled_from([torch.bfloat16, torch.float16]),
    st.one_of(st.none(), st.integers(1, 512)),
    st.one_of(st.none(), st.just(30.0)),
    st.booleans(),
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_fuzzed_layouts(groups, heads, d, dtype, window, softcap, deterministic):
    layout = pack_groups(groups, pad_to_multiple_of=8).layout.to("cuda")
    check_flash_style(layout, *heads, d, dtype, window_size=window, softcap=softcap, deterministic=deterministic)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_dims(d, dtype):
    layout = DualKVLayout((1000, 1), ((129, 700, 1, 64), (1, 1)), pad_len=3).to("cuda")
    check_flash_style(layout, 8, 2, d, dtype, window_size=300 if d >= 256 else None, deterministic=d in (96, 256))


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_fused_dq_at_every_head_dim(d, monkeypatch):
    """dQ accumulated by the dK/dV pass (TMA bulk reductions on Hopper) also where the defaults run the dQ pass."""
    from megatron_dualkv.ops import dualkv_attn as kernels

    fitting = ((128, kernels.KernelConfig(64, 128, 8, 3)), (256, kernels.KernelConfig(32, 64, 8, 2)))
    monkeypatch.setitem(kernels.GPU_CONFIGS, "dkdv_dq", fitting)
    layout = DualKVLayout((1000, 1), ((129, 700, 1, 64), (1, 1)), pad_len=3).to("cuda")
    check_flash_style(layout, 8, 2, d, torch.bfloat16, window_size=300 if d == 192 else None,
                      softcap=30.0 if d == 96 else None)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_float32_dots_are_not_tf32(d):
    """Float32 inputs multiply in full float32: Triton's TF32 default misses this bound by ~1000x."""
    layout = DualKVLayout((300, 1), ((129, 70), (5,)), pad_len=3).to("cuda")
    check_flash_style(layout, 4, 2, d, torch.float32, eps=1e-6, window_size=100)


# a prompt and two levels of turns, paths of one, two and three pieces, padding
TREE = TreeLayout((1500, 300, 200, 129, 700, 1, 64, 300), (-1, 0, 1, 0, 3, 3, 5, 0), pad_len=3)


def test_deterministic_tree_gradients_are_bitwise_equal():
    layout = TREE.to("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(layout.total_tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (16, 4, 4))
    dout = torch.randn_like(q)
    first = grads(layout, q, k, v, dout, "triton", deterministic=True, window_size=400)
    second = grads(layout, q, k, v, dout, "triton", deterministic=True, window_size=400)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@given(
    trajectory_sets(max_groups=3, max_segment=400, max_segments=10, vocab=1000),
    st.sampled_from([(8, 2), (6, 1)]),
    st.sampled_from([64, 128]),
    st.sampled_from([torch.bfloat16, torch.float16]),
    st.one_of(st.none(), st.integers(1, 512)),
    st.one_of(st.none(), st.just(30.0)),
    st.booleans(),
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_fuzzed_trees(trajectories, heads, d, dtype, window, softcap, deterministic):
    layout = pack_trajectories(trajectories, pad_to_multiple_of=8).layout.to("cuda")
    check_flash_style(layout, *heads, d, dtype, window_size=window, softcap=softcap, deterministic=deterministic)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256, 512])
def test_tree_head_dims(d):
    check_flash_style(TREE.to("cuda"), 8, 2, d, torch.bfloat16, window_size=300 if d >= 256 else None,
                      deterministic=d in (96, 256), softcap=30.0 if d == 192 else None)
