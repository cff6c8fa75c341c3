"""FlashAttention-4 on layouts of plain causal sequences (``ops.fa4_chains``).

On CPU: which layouts are chains, and that on every such layout the DualKV mask is causal
attention within each chain (what makes FA4's varlen kernel exact there), fuzzed over trees and
groups. On an H200 with ``flash-attn-4`` installed: ``dualkv_attn_func(backend="auto")`` takes FA4
on chains, within the flash bound for the output and every gradient, and keeps our kernels wherever
FA4 was not measured faster."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, TreeLayout
from megatron_dualkv.ops.fa4_chains import chain_starts, fa4_installed, fa4_takes
from strategies import layout_lengths, tree_lengths


def _causal_within(starts, total):
    """(T, T) causal attention inside each [starts[i], starts[i + 1])."""
    mask = torch.zeros(total, total, dtype=torch.bool)
    for a, b in zip(starts, starts[1:]):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return mask


@pytest.mark.parametrize("layout, starts", [
    (DualKVLayout((5, 3), ((4,), (2,))), (0, 9, 14)),
    (DualKVLayout((5, 3), ((4,), (2,)), pad_len=3), (0, 9, 14, 17)),
    (DualKVLayout((5,), ((),)), (0, 5)),
    (TreeLayout((3, 2, 4), (-1, 0, 1)), (0, 9)),
    (TreeLayout((3, 2, 4, 1), (-1, 0, -1, 2), pad_len=2), (0, 5, 10, 12)),
    (DualKVLayout((5, 3), ((4, 1), (2,))), None),
    (TreeLayout((3, 2, 4), (-1, 0, 0)), None),
])
def test_chain_starts(layout, starts):
    assert chain_starts(layout) == starts


@st.composite
def chain_or_not_layouts(draw):
    if draw(st.booleans()):
        prompt_lens, response_lens = layout_lengths(draw, max_responses=2)
        return DualKVLayout(prompt_lens, response_lens, pad_len=draw(st.integers(0, 3)))
    return TreeLayout(*tree_lengths(draw, max_segments=8, max_len=5), pad_len=draw(st.integers(0, 3)))


@given(chain_or_not_layouts())
@settings(max_examples=80, deadline=None)
def test_the_mask_of_a_chain_layout_is_causal_per_chain(layout):
    """Where ``chain_starts`` answers, the DualKV mask (dense, from the rule) is causal attention per
    chain; where it refuses, it is not."""
    starts = chain_starts(layout)
    if starts is None:
        bounds = [n.root_start for n in layout.nodes if n.parent < 0] + [layout.total_tokens]
        assert not torch.equal(layout.dense_mask(), _causal_within(bounds, layout.total_tokens))
    else:
        assert torch.equal(layout.dense_mask(), _causal_within(starts, layout.total_tokens))


def test_fa4_takes_nothing_off_the_gpu():
    layout = DualKVLayout((5,), ((4,),))
    assert not fa4_takes(torch.zeros(9, 4, 128, dtype=torch.bfloat16), layout, None, None, False)


on_fa4_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and fa4_installed()),
    reason="needs an sm_90 GPU and flash-attn-4")


@on_fa4_gpu
@pytest.mark.parametrize("layout", [  # one chain, chains of one length (FA4's batched kernel), uneven chains
    DualKVLayout((300,), ((257,),)),
    DualKVLayout((200, 100), ((57,), (157,))),
    DualKVLayout((1, 129, 77), ((1,), (2,), (300,)), pad_len=5),
    TreeLayout((64, 1, 200, 17), (-1, 0, 1, -1), pad_len=3),
])
def test_auto_takes_fa4_on_chains_within_the_flash_bound(layout):
    from flash_check import check_flash_style

    layout = layout.to("cuda")
    q = torch.empty(layout.total_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert fa4_takes(q, layout, None, None, False)
    check_flash_style(layout, 8, 2, 128, torch.bfloat16, backend="auto")


@on_fa4_gpu
def test_auto_keeps_our_kernels_where_fa4_was_not_faster(monkeypatch):
    chains, shared = DualKVLayout((300,), ((257,),)).to("cuda"), DualKVLayout((300,), ((257, 9),)).to("cuda")
    q = torch.empty(chains.total_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert not fa4_takes(torch.empty(shared.total_tokens, 8, 128, device="cuda", dtype=torch.bfloat16), shared,
                         None, None, False)
    assert not fa4_takes(q, chains, 64, None, False)
    assert not fa4_takes(q, chains, None, 30.0, False)
    assert not fa4_takes(q, chains, None, None, True)
    assert not fa4_takes(q.half(), chains, None, None, False)
    assert not fa4_takes(torch.empty(chains.total_tokens, 8, 256, device="cuda", dtype=torch.bfloat16), chains,
                         None, None, False)
    monkeypatch.setenv("DUALKV_FA4", "0")
    assert not fa4_takes(q, chains, None, None, False)
