"""Triton DualKV kernels on CPU (interpreter, tiny shapes) against the float64 reference: for prompt and
response groups, and for prefix trees against the replicated layout (each trajectory one causal sequence)."""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, Trajectory, TreeLayout, dualkv_attn_func, pack_groups, pack_trajectories
from megatron_dualkv.ops import dualkv_attn as kernels
from megatron_dualkv.ops.dualkv_attn import (KernelConfig, ancestor_pieces, kernel_config, kernel_tables, key_items,
                                             multi_range, piece_table, query_tiles)
from strategies import layout_lengths, rollout_groups, trajectory_sets, tree_lengths

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests; GPU has its own module")


def run_both(layout, hq, hkv, d, window=None, softcap=None, scale=None, seed=0, deterministic=False):
    """Kernel (float32) and reference (float64) outputs and q/k/v gradients for one random input."""
    g = torch.Generator().manual_seed(seed)
    T = layout.total_tokens
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(T, hq, d, generator=g)
    results = []
    for dtype, backend in ((torch.float32, "triton"), (torch.float64, "reference")):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = dualkv_attn_func(*x, layout, scale, window, softcap, deterministic, backend=backend)
        results.append((out, *torch.autograd.grad(out, x, dout.to(dtype))))
    return results


def assert_matches(got, want, tol=2e-5):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        err = (a.double() - b).abs().max().item()
        assert err <= tol * (1 + b.abs().max().item()), f"{name}: max error {err:.3e}"


@given(
    rollout_groups(max_groups=3, max_prompt=40, max_responses=3, max_response=24),
    st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    st.sampled_from([16, 24]),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.floats(1.0, 10.0)),
    st.sampled_from([1, 16]),
    st.booleans(),
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_kernels_match_reference(groups, heads, d, window, softcap, multiple, deterministic):
    layout = pack_groups(groups, pad_to_multiple_of=multiple).layout
    got, want = run_both(layout, *heads, d, window, softcap, scale=0.9 / d**0.5, deterministic=deterministic)
    assert_matches(got, want)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256, 512])
def test_head_dims(d):
    layout = DualKVLayout((19,), ((5, 17, 1),))
    got, want = run_both(layout, 4, 2, d, window=11 if d in (128, 512) else None)
    assert_matches(got, want)


def test_many_groups_with_p1_and_r1_and_split_key_tiles():
    layout = DualKVLayout((1, 33, 2, 1, 50), ((1,), (1, 40, 2), (3, 3, 3, 3), (20,), (1, 1)), pad_len=7)
    block = kernel_config("dkdv", 16, layout.device)
    _, reduce, slots = key_items(layout, block.block_n, block.block_m, 1, 4)
    assert reduce.shape[0] > 0 and slots > reduce.shape[0], "the layout should exercise chunked key tiles"
    for deterministic in (False, True):
        got, want = run_both(layout, 2, 1, 16, window=9, softcap=5.0, deterministic=deterministic)
        assert_matches(got, want)


def test_split_tiles_reduce_in_row_slices():
    """The chunk partials of split key tiles, summed with each tile's rows spread over several
    programs (``ROWS`` below the tile): every row gets its own slots' sum, in slot order, and rows
    past a tile's end are left alone."""
    hkv, d, block_n, rows = 2, 32, 16, 4
    reduce = torch.tensor([(0, 16, 0, 3), (16, 29, 3, 2)], dtype=torch.int32)  # the second tile ends at 29
    g = torch.Generator().manual_seed(0)
    partial_dk, partial_dv = (torch.randn(5 * block_n, hkv, d, generator=g) for _ in range(2))
    dk, dv = (torch.full((32, hkv, d), 7.0) for _ in range(2))
    kernels._bwd_reduce_kernel[(2 * hkv, block_n // rows)](
        partial_dk, partial_dv, dk, dv, reduce, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_D=d, BLOCK_N=block_n, ROWS=rows)
    for out, partial in ((dk, partial_dk), (dv, partial_dv)):
        for k0, k1, slot0, n in reduce.tolist():
            expected = partial[slot0 * block_n:(slot0 + 1) * block_n]
            for s in range(slot0 + 1, slot0 + n):
                expected = expected + partial[s * block_n:(s + 1) * block_n]
            assert torch.equal(out[k0:k1], expected[:k1 - k0])
        assert torch.equal(out[29:], torch.full((3, hkv, d), 7.0))


def test_gpu_plans_by_dtype_and_window():
    """The GPU block plans (chosen on the host, so checkable here): windows take their own dK/dV
    blocks where measured (D=256), float32 takes the small blocks its full-float32 dots compile at."""
    gpu = torch.device("cuda", 0)
    assert kernels.backward_plan(256, gpu, True, windowed=True)[1] == kernels.GPU_CONFIGS["dkdv_window"][1][1]
    assert kernels.backward_plan(256, gpu, True)[1] == kernel_config("dkdv", 256, gpu)
    assert kernels.backward_plan(128, gpu, True, windowed=True)[1] == kernel_config("dkdv", 128, gpu)
    assert kernels.backward_plan(128, gpu, False, dtype=torch.float32) == (None, kernels.SMALL_BLOCKS)
    assert kernel_config("fwd", 512, gpu, torch.float32) == kernels.SMALL_BLOCKS


@pytest.mark.parametrize("d", [32, 48])
def test_tma_loads(d, monkeypatch):
    """The TMA path, emulated by the interpreter (48: not a power of two, so pointer loads remain)."""
    monkeypatch.setattr(kernels, "SMALL_BLOCKS", KernelConfig(16, 16, 1, 1, tma=True))
    layout = DualKVLayout((1, 33, 2), ((1,), (1, 40, 2), (3, 3, 3, 3)), pad_len=7)
    for deterministic, window, softcap in ((False, None, None), (True, 9, 5.0)):
        got, want = run_both(layout, 4, 2, d, window=window, softcap=softcap, deterministic=deterministic)
        assert_matches(got, want)


def test_tma_loads_fall_back_on_unaligned_strides(monkeypatch):
    """A TMA box needs 16-byte aligned strides: a (T, H, 16) view of (T, H, 17) floats keeps pointer loads."""
    cfg = KernelConfig(16, 16, 1, 1, tma=True)
    monkeypatch.setattr(kernels, "SMALL_BLOCKS", cfg)
    layout = DualKVLayout((20,), ((7, 18),))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(layout.total_tokens, h, 17, generator=g)[:, :, :16] for h in (4, 2, 2))
    assert kernels._tma_loads(cfg, 16, q.contiguous()) and not kernels._tma_loads(cfg, 16, k)
    got = dualkv_attn_func(q, k, v, layout, backend="triton")
    want = dualkv_attn_func(q.double(), k.double(), v.double(), layout, backend="reference")
    assert (got.double() - want).abs().max().item() < 2e-5


def test_gradients_are_bitwise_reproducible():
    layout = DualKVLayout((40, 9), ((30, 2), (12,)))
    first, second = (run_both(layout, 4, 1, 16, seed=3, deterministic=True)[0] for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def assert_key_items_cover_the_mask(layout, window, block_n, block_m, sm_count):
    """Each (query, key) pair the mask allows lies in exactly one dK/dV work item, and every query
    row of an item sees some key of its tile: a window leaves no item of invisible queries."""
    items, reduce, slots = key_items(layout, block_n, block_m, 2, sm_count, window)
    used = sorted(r[4] for r in items.tolist() if r[4] >= 0)
    assert used == list(range(slots)) and sum(r[3] for r in reduce.tolist()) == slots
    count = torch.zeros(layout.total_tokens, layout.total_tokens, dtype=torch.int32)
    for k0, k1, q0, q1, _ in items.tolist():
        count[q0:q1, k0:k1] += 1
    mask = layout.dense_mask(window)
    assert torch.all(count[mask] == 1)
    for k0, k1, q0, q1, _ in items.tolist():
        assert mask[q0:q1, k0:k1].any(1).all(), f"item {(k0, k1, q0, q1)} holds queries that see none of its keys"
    if window is not None:  # the kernel finds the queries that see a whole tile from an item's first position
        pos = layout.position_ids.cpu()
        for k0, k1, q0, q1, _ in items.tolist():
            assert torch.equal(pos[q0:q1] - pos[q0], torch.arange(q1 - q0, dtype=pos.dtype)), f"item {(k0, k1, q0, q1)}"
    if window is None:  # outside the mask, items only hold the causal triangle of their diagonal blocks
        assert torch.all(count[~mask & (torch.arange(layout.total_tokens)[:, None] > torch.arange(layout.total_tokens))] == 0)


@pytest.mark.parametrize("window", [None, 1, 7, 30])
def test_key_items_cover_every_visible_pair_once(window):
    assert_key_items_cover_the_mask(DualKVLayout((45, 3), ((20, 31, 1), (2,)), pad_len=5), window, 16, 16, 8)


@given(st.data(), st.one_of(st.none(), st.integers(1, 60)), st.sampled_from([(16, 16), (8, 4), (32, 16)]),
       st.sampled_from([1, 8, 132]))
@settings(max_examples=40, deadline=None)
def test_key_items_cover_the_mask_on_fuzzed_layouts(data, window, blocks, sm_count):
    prompts, responses = layout_lengths(data.draw, max_groups=4, max_prompt=50, max_responses=4, max_response=40)
    layout = DualKVLayout(prompts, responses, pad_len=data.draw(st.sampled_from([0, 5])))
    assert_key_items_cover_the_mask(layout, window, *blocks, sm_count)


def test_key_items_follow_the_window():
    """A window leaves a prompt's last key tiles one query range per response (each response's first
    queries), split into partial-sum slots, and its earlier tiles only the prompt's queries."""
    layout = DualKVLayout((96,), ((40, 40, 40),))
    items, reduce, _ = key_items(layout, 16, 16, 1, 1, window=24)
    last_tile = [q for r in items.tolist() if r[0] == 80 for q in range(r[2], r[3])]
    # the prompt's rest, then the queries at positions 96..118 (< 95 + 24) of each response
    assert sorted(last_tile) == [*range(80, 119), *range(136, 159), *range(176, 199)]
    assert any(r[0] == 80 and r[3] >= 3 for r in reduce.tolist())
    assert all(r[3] <= 96 for r in items.tolist() if r[0] < 64)  # reach 63 + 24 < 96: no response query
    full, _, _ = key_items(layout, 16, 16, 1, 1)
    assert (items[:, 3] - items[:, 2]).sum() < (full[:, 3] - full[:, 2]).sum() / 2
    for deterministic in (False, True):
        got, want = run_both(layout, 2, 1, 16, window=24, deterministic=deterministic)
        assert_matches(got, want)


def test_key_items_list_group_aligned_query_chunks_in_order():
    """Items running at once should share query rows (dQ and Q/dO stay in L2): the chunks are
    aligned to the group, not to the key tile, and the table lists them chunk by chunk."""
    layout = DualKVLayout((300,), ((50,) * 6,))
    items, _, _ = key_items(layout, 16, 16, 1, 1)
    q_lo, q_hi = items[:, 2].long(), items[:, 3].long()
    chunk = int((q_hi - q_lo).max())
    assert chunk < layout.total_tokens - 16, "the layout should split the prompt's key tiles"
    assert torch.equal(q_lo // chunk, (q_hi - 1) // chunk), "an item crosses a chunk boundary"
    assert torch.all((q_lo // chunk).diff() >= 0), "the table is not in chunk order"


def test_tables_are_cached_per_layout():
    layout = DualKVLayout((5,), ((3,),))
    assert kernel_tables(layout, 16, 1).fwd_tiles is kernel_tables(layout, 16, 1).fwd_tiles


@pytest.mark.parametrize("layout", [DualKVLayout((13,), ((6, 9),)), TreeLayout((5, 4, 3, 6, 2), (-1, 0, 1, 0, 3), 8)],
                         ids=["depth1", "tree"])
def test_torch_compile_sees_an_opaque_op(layout):
    q, k, v = (torch.randn(28, h, 16, requires_grad=True) for h in (2, 1, 1))

    def f(q, k, v):
        return dualkv_attn_func(q, k, v, layout, backend="triton").square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=False)
    loss, grads = compiled(q, k, v), None
    grads = torch.autograd.grad(loss, (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch.testing.assert_close(loss, f(q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_head_dim_above_512_is_refused():
    layout = DualKVLayout((2,), ((1,),))
    x = torch.zeros(3, 1, 640)
    with pytest.raises(ValueError, match="head_dim <= 512"):
        dualkv_attn_func(x, x, x, layout, backend="triton")


def test_triton_backend_refused_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layout = DualKVLayout((2,), ((1,),))
    x = torch.zeros(3, 1, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dualkv_attn_func(x, x, x, layout, backend="triton")


# ==================================================================================== prefix trees
def replicated_reference(batch, q, k, v, dout, scale=None, window=None, softcap=None):
    """Float64 outputs and q/k/v gradients on the replicated layout: every trajectory (and the
    padding) one causal sequence of copies of its packed tokens; each packed token's output read
    from one of its copies (all equal), gradients summed over the copies."""
    T = batch.num_tokens
    padding = [torch.arange(T - batch.layout.pad_len, T)] if batch.layout.pad_len else []
    sequences = list(batch.trajectory_index) + padding
    index = torch.cat(sequences)
    layout = DualKVLayout(tuple(map(len, sequences)), ((),) * len(sequences))
    x = [t.double().requires_grad_() for t in (q, k, v)]
    out_rep = dualkv_attn_func(*(t[index] for t in x), layout, scale, window, softcap, backend="reference")
    copy = torch.empty(T, dtype=torch.long)
    copy[index] = torch.arange(index.numel())
    out = out_rep[copy]
    return (out, *torch.autograd.grad(out, x, dout.double()))


def run_tree(batch, hq, hkv, d, window=None, softcap=None, scale=None, seed=0, deterministic=False):
    """The Triton kernels (float32) on the packed tree, the replicated float64 reference."""
    g = torch.Generator().manual_seed(seed)
    T = batch.num_tokens
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(T, hq, d, generator=g)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dualkv_attn_func(*x, batch.layout, scale, window, softcap, deterministic, backend="triton")
    return (out, *torch.autograd.grad(out, x, dout)), replicated_reference(batch, q, k, v, dout, scale, window, softcap)


def agent_episodes():
    """Two groups: multi-turn episodes (a 21-token prompt, turns of 3 to 20 tokens, episodes that
    share turns, one ending inside another, one a single token past the prompt; the deepest paths
    three pieces), and a tree search that branches at inner tokens of its root's first child."""
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, 1000, (n,), generator=g).tolist()  # noqa: E731
    prompt, turn, short = ids(21), ids(17), ids(3)
    episodes = [prompt + ids(19), prompt + turn + ids(20), prompt + turn + short + ids(18),
                prompt + turn + short + ids(6), prompt + ids(1)]
    episodes.append(episodes[1][:45])  # ends inside its sibling's second turn
    root, branch = ids(3), ids(18)
    search = [root + branch[:5] + ids(2), root + branch + ids(1), root + branch + ids(4), root + ids(2)]
    return [Trajectory(t, group=0) for t in episodes] + [Trajectory(t, group=1) for t in search]


@given(
    trajectory_sets(max_groups=2, max_segment=8, max_segments=8),
    st.sampled_from([(2, 1), (2, 2)]),
    st.sampled_from([16, 24]),
    st.one_of(st.none(), st.integers(1, 40)),
    st.one_of(st.none(), st.just(5.0)),
    st.sampled_from([1, 16]),
    st.booleans(),
)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_tree_kernels_match_the_replicated_layout(trajectories, heads, d, window, softcap, multiple, deterministic):
    batch = pack_trajectories(trajectories, pad_to_multiple_of=multiple)
    assume(multi_range(batch.layout))  # single-range trees run the depth-1 code, fuzzed above
    got, want = run_tree(batch, *heads, d, window, softcap, scale=0.9 / d**0.5, deterministic=deterministic)
    assert_matches(got, want)


@pytest.mark.parametrize("window, softcap, deterministic", [(None, None, False), (9, 5.0, True)])
def test_agent_episodes_and_tree_search(window, softcap, deterministic):
    """Segments over several blocks, tiles with two and three ancestor pieces, key tiles split into
    query chunks, a window shorter than a segment and reaching over several."""
    batch = pack_trajectories(agent_episodes(), pad_to_multiple_of=16)
    assert max(map(len, ancestor_pieces(batch.layout))) == 3
    _, reduce, _ = key_items(batch.layout, 16, 16, 1, 4, window)
    assert reduce.shape[0] > 0
    got, want = run_tree(batch, 1, 1, 16, window, softcap, deterministic=deterministic)  # GQA: fuzzed above
    assert_matches(got, want)


def test_tree_gradients_are_bitwise_reproducible():
    layout = pack_trajectories([t for t in agent_episodes() if t.group == 1]).layout  # the tree search
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(layout.total_tokens, h, 16, generator=g, requires_grad=True) for h in (2, 1, 1))
    dout = torch.randn_like(q)
    first, second = (torch.autograd.grad(dualkv_attn_func(q, k, v, layout, window_size=9, deterministic=True,
                                                          backend="triton"), (q, k, v), dout) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_tma_loads_on_trees(monkeypatch):
    """The pieces streamed as TMA boxes (emulated by the interpreter)."""
    monkeypatch.setattr(kernels, "SMALL_BLOCKS", KernelConfig(16, 16, 1, 1, tma=True))
    search = [t for t in agent_episodes() if t.group == 1]
    got, want = run_tree(pack_trajectories(search), 2, 1, 32, window=20, deterministic=True)
    assert_matches(got, want)


def assert_query_tiles_cover_the_mask(layout, window, block_m):
    """Every row of every query tile lies in the tile's segment, the tiles cover every query once,
    and the keys a tile reads (its pieces, its segment up to the tile) hold every key its rows may
    see, each kept piece holding one that some row sees (the window trims only invisible pieces)."""
    tiles, pieces, mask = query_tiles(layout, block_m, window), piece_table(layout), layout.dense_mask(window)
    covered = torch.zeros(layout.total_tokens, dtype=torch.int32)
    for q0, q1, seg_start, seg_pos, lo, hi in tiles.tolist():
        covered[q0:q1] += 1
        node = next(n for n in layout.nodes if n.start == seg_start)
        assert seg_start + node.length >= q1 - 1 and seg_pos == node.position
        reads = torch.zeros(layout.total_tokens, dtype=torch.bool)
        reads[seg_start:q1] = True
        for start, length, position in pieces[lo:hi].tolist():
            assert int(layout.position_ids[start]) == position
            assert mask[q0:q1, start:start + length].any(), "a piece that no row sees"
            reads[start:start + length] = True
        assert not (mask[q0:q1] & ~reads).any(), f"tile {(q0, q1)} misses keys it sees"
    assert torch.all(covered == 1)


@given(st.data(), st.one_of(st.none(), st.integers(1, 30)), st.sampled_from([(16, 16), (8, 4)]))
@settings(max_examples=40, deadline=None)
def test_tree_tables_cover_the_mask(data, window, blocks):
    lengths = tree_lengths(data.draw, max_segments=14, max_len=20)
    layout = TreeLayout(*lengths, pad_len=data.draw(st.sampled_from([0, 5])))
    assert_key_items_cover_the_mask(layout, window, *blocks, 8)
    if multi_range(layout):
        assert_query_tiles_cover_the_mask(layout, window, blocks[1])


@pytest.mark.parametrize("blocks", [(16, 16), (4, 8)])
def test_tree_tables_cover_the_mask_at_every_window(blocks):
    """Windows that end exactly at a piece's last key or a segment's first, on fixed trees."""
    small = TreeLayout((4, 3, 2, 5, 1, 3), (-1, 0, 1, 0, 3, 3), pad_len=2)
    episodes = pack_trajectories(agent_episodes()).layout
    for layout, windows in ((small, range(1, small.max_logical_len + 2)), (episodes, (1, 17, 22, 39))):
        for window in windows:
            assert_key_items_cover_the_mask(layout, window, *blocks, 8)
            assert_query_tiles_cover_the_mask(layout, window, blocks[1])


def test_ancestor_pieces_merge_first_children():
    """A first child follows its parent in packed order too: one piece; a later child's path breaks there."""
    layout = TreeLayout((4, 3, 2, 5, 1), (-1, 0, 1, 0, 3))
    assert ancestor_pieces(layout) == ((), ((0, 4, 0),), ((0, 7, 0),), ((0, 4, 0),), ((0, 4, 0), (9, 5, 4)))
    assert multi_range(layout)
    chain = TreeLayout((4, 3, 2, 2), (-1, 0, 1, 1))  # every path one packed range: the depth-1 tables
    assert not multi_range(chain) and piece_table(chain) is None
    assert query_tiles(chain, 16).shape[1] == 5
