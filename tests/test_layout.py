import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, TreeLayout
from strategies import layout_lengths, tree_lengths


@st.composite
def layouts(draw):
    prompts, responses = layout_lengths(draw)
    return DualKVLayout(prompts, responses, draw(st.integers(0, 5)))


@given(layouts())
@settings(max_examples=60, deadline=None)
def test_layout_invariants(layout):
    T = layout.total_tokens
    cu = layout.cu_seqlens
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T
    assert torch.all(torch.diff(cu) > 0)
    assert torch.diff(cu).tolist() == list(layout.segment_lens)
    assert layout.group_start[-1] == T
    assert layout.position_ids.shape == (T,)
    assert layout.max_seqlen == max(layout.segment_lens)
    assert layout.max_prompt_len == max(layout.prompt_lens)
    assert layout.max_response_len == max(r for rs in layout.response_lens for r in rs)
    # every segment's prefix is its own group's prompt; responses see it, prompts see nothing extra
    for s, (start, length, prefix_start, prefix_len) in enumerate(layout.segments):
        g = int(layout.segment_group[s])
        assert start == int(cu[s]) and length == int(cu[s + 1] - cu[s])
        assert prefix_start == int(layout.group_start[g])
        assert bool(layout.segment_is_prompt[s]) == (prefix_len == 0)
        if prefix_len:
            assert prefix_len == layout.prompt_lens[g]
            assert layout.position_ids[start].item() == prefix_len


@given(layouts(), st.one_of(st.none(), st.integers(1, 6)))
@settings(max_examples=60, deadline=None)
def test_dense_mask_rule(layout, window):
    """The mask against a token-by-token reading of the rule, written independently."""
    mask = layout.dense_mask(window)
    owner = []  # (group, segment, is_prompt, position) per token
    for g, (p, rs) in enumerate(layout.groups_with_padding()):
        owner += [(g, (g, -1), True, i) for i in range(p)]
        for j, r in enumerate(rs):
            owner += [(g, (g, j), False, p + i) for i in range(r)]
    for qi, (gq, sq, _, pq) in enumerate(owner):
        for ki, (gk, sk, k_prompt, pk) in enumerate(owner):
            allowed = gq == gk and (k_prompt or sq == sk) and pk <= pq and (window is None or pq - pk < window)
            assert bool(mask[qi, ki]) == allowed, (qi, ki)


def test_to_device_is_cached_and_keeps_metadata():
    layout = DualKVLayout((3,), ((2, 1),), 2)
    meta = layout.to("meta")
    assert meta.device.type == "meta" and meta.prompt_lens == (3,) and meta.cu_seqlens.device.type == "meta"
    assert layout.to("meta") is meta and layout.to("cpu") is layout


@pytest.mark.parametrize(
    "args, message",
    [
        (((0,), ((1,),)), "group 0 has a prompt of length 0"),
        (((2,), ((1, 0),)), "group 0 has a response of length 0"),
        (((2,), ((-1,),)), "group 0 has a response of length -1"),
        (((2, 3), ((1,),)), "2 prompt lengths but 1"),
        (((2,), ((1,),), -1), "pad_len"),
        (((2**31,), ((1,),)), "overflow int32"),
    ],
)
def test_bad_lengths(args, message):
    with pytest.raises(ValueError, match=message):
        DualKVLayout(*args)


@given(layouts(), st.one_of(st.none(), st.integers(1, 6)))
@settings(max_examples=40, deadline=None)
def test_attention_pairs_counts_the_mask(layout, window):
    assert layout.attention_pairs(window) == int(layout.dense_mask(window).sum())


@st.composite
def tree_layouts(draw):
    return TreeLayout(*tree_lengths(draw), pad_len=draw(st.integers(0, 5)))


@given(tree_layouts(), st.one_of(st.none(), st.integers(1, 6)))
@settings(max_examples=60, deadline=None)
def test_tree_mask_rule(layout, window):
    """The mask and the nodes against a token-by-token reading of the rule: walk each query's
    segment up through its parents."""
    parents = layout.segment_parent + ((-1,) if layout.pad_len else ())
    lens = layout.segment_lens + ((layout.pad_len,) if layout.pad_len else ())
    owner, position = [], []  # per token: its segment, its position along the path
    for s, length in enumerate(lens):
        p, first = parents[s], 0
        while p >= 0:
            first += lens[p]
            p = parents[p]
        owner += [s] * length
        position += list(range(first, first + length))

    def ancestors_or_self(s):
        while s >= 0:
            yield s
            s = parents[s]

    mask = layout.dense_mask(window)
    for q in range(len(owner)):
        path = set(ancestors_or_self(owner[q]))
        for k in range(len(owner)):
            in_window = window is None or position[q] - position[k] < window
            allowed = owner[k] in path and position[k] <= position[q] and in_window
            assert bool(mask[q, k]) == allowed, (q, k)
    assert layout.position_ids.tolist() == position
    assert torch.diff(layout.cu_seqlens).tolist() == list(lens) and layout.total_tokens == len(owner)
    assert layout.attention_pairs(window) == int(mask.sum())
    for s, node in enumerate(layout.nodes):
        chain = list(ancestors_or_self(s))[::-1]
        assert node.ancestors == tuple((layout.nodes[a].start, lens[a]) for a in chain[:-1])
        assert node.position == position[node.start] and node.root_start == layout.nodes[chain[0]].start
        inside = [t for t in range(len(owner)) if s in set(ancestors_or_self(owner[t]))]
        assert (node.start, node.subtree_end) == (inside[0], inside[-1] + 1)
        assert len(inside) == node.subtree_end - node.start
    assert layout.max_depth == max(len(n.ancestors) for n in layout.nodes)
    assert layout.max_logical_len == max(position) + 1


def test_dualkv_layout_is_a_depth_one_forest():
    layout = DualKVLayout((3, 2), ((2, 1), ()), pad_len=2)
    assert [n.parent for n in layout.nodes] == [-1, 0, 0, -1, -1]
    assert [n.ancestors for n in layout.nodes] == [(), ((0, 3),), ((0, 3),), (), ()]
    assert [n.subtree_end for n in layout.nodes] == [6, 5, 6, 8, 10]
    assert layout.max_depth == 1


def test_tree_to_device_is_cached():
    layout = TreeLayout((3, 2, 1), (-1, 0, 0), pad_len=2)
    meta = layout.to("meta")
    assert meta.device.type == "meta" and meta.segment_parent == (-1, 0, 0) and meta.position_ids.device.type == "meta"
    assert layout.to("meta") is meta and layout.to("cpu") is layout


@pytest.mark.parametrize(
    "args, message",
    [
        (((2, 0), (-1, 0)), "segment 1 has length 0"),
        (((2, 1), (-1,)), "2 segment lengths but 1 parents"),
        (((2, 1), (-1, -2)), "segment 1 has parent -2"),
        (((2, 1), (-1, 1)), "segment 1 has parent 1, which is neither segment 0 nor one of its ancestors"),
        (((2, 1, 1), (-1, 0, -1, 1)), "3 segment lengths but 4"),
        (((2, 1, 1, 1), (-1, 0, -1, 1)), "segment 3 has parent 1, which is neither segment 2"),
        (((2, 1.5), (-1, 0)), "segment 1 has length 1.5"),
        (((2, 1), (-1, True)), "segment 1 has parent True"),
        (((2,), (-1,), -1), "pad_len"),
        (((2**31,), (-1,)), "overflow int32"),
    ],
)
def test_bad_trees(args, message):
    with pytest.raises(ValueError, match=message):
        TreeLayout(*args)
