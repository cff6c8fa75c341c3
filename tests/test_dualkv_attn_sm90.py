"""Native sm_90 kernels (csrc/dualkv_*_sm90.cu): on a Hopper GPU, the default backend's
outputs and gradients within 2x the error of the same-precision PyTorch reference, on fuzzed and edge layouts
and prefix trees, and the forward instantiation each kind of table launches; elsewhere, that they are never
chosen, and (a stand-in for the built extension) the tables the native forward is handed."""
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dualkv import DualKVLayout, TreeLayout, dualkv_attn_func, pack_groups, pack_trajectories
from megatron_dualkv.ops import dualkv_attn as kernels
from megatron_dualkv.ops import dualkv_attn_sm90 as sm90
from megatron_dualkv.ops.dualkv_attn import kernel_config, kernel_tables
from megatron_dualkv.ops.dualkv_attn_sm90 import dq_in_head_dim_order, native_supported
from flash_check import check_flash_style
from strategies import rollout_groups, trajectory_sets


@pytest.fixture(autouse=True)
def our_kernels_on_chains_too(monkeypatch):
    """These tests are of our kernels: where flash-attn-4 is installed, the default backend would hand
    the layouts of plain causal sequences to FA4 (``ops.fa4_chains``, tested in test_fa4_chains.py)."""
    monkeypatch.setenv("DUALKV_FA4", "0")


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="needs an sm_90 GPU")


def tensors(d=128, dtype=torch.bfloat16, device="cpu", heads=(8, 2)):
    return [torch.zeros(64, h, d, dtype=dtype, device=device) for h in (heads[0], heads[1], heads[1])]


def test_not_chosen_off_hopper_or_outside_its_cases():
    assert not native_supported(*tensors(), None, None, False)
    if torch.cuda.is_available():
        cuda = tensors(device="cuda")
        assert not native_supported(*tensors(64, device="cuda"), None, None, False)
        assert not native_supported(*tensors(dtype=torch.float32, device="cuda"), None, None, False)
        assert not native_supported(*tensors(512, device="cuda"), 100, None, False)
        assert not native_supported(*cuda, None, 30.0, False)
        assert not native_supported(*cuda, None, None, True)


@pytest.mark.parametrize("d", [128, 256, 512])
def test_dq_buffer_order_is_undone(d):
    """The path of a dQ block through the kernels, modelled per lane: a warpgroup's stores of its
    (64, 64) accumulator into two swizzled (64, 32) shared-memory boxes (``stage_dq``), then the
    copy engine adding each box's rows, un-swizzled, to 32 consecutive columns of the buffer."""
    T, H = 64, 2
    dq = torch.randn(T, H, d, dtype=torch.float64)
    buffer = torch.zeros(T, H, d, dtype=torch.float64)
    for h in range(H):
        for col0 in range(0, d, 64):  # one warpgroup's 64 columns
            boxes = torch.zeros(2, 64, 32, dtype=torch.float64)  # (box, row, 4-byte word)
            for lane in range(128):
                wq, g, c = lane // 32, lane % 32 // 4, lane % 4
                for i in range(8):
                    for r in range(2):
                        row = 16 * wq + g + 8 * r
                        word = (((4 * (c // 2) + i % 4) ^ g) * 16 + 8 * (c % 2)) // 4
                        cols = col0 + 8 * i + 2 * c
                        boxes[i // 4, row, word:word + 2] = dq[row, h, cols:cols + 2]
            for b in range(2):
                for row in range(64):
                    unswizzled = boxes[b, row].view(8, 4)[[k ^ row % 8 for k in range(8)]].flatten()
                    buffer[row, h, col0 + 32 * b:col0 + 32 * b + 32] += unswizzled
    assert not torch.equal(buffer, dq)  # the order differs, and is undone (a Triton kernel: compiled on a GPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.equal(dq_in_head_dim_order(buffer.to(device), torch.float64).cpu(), dq)


@pytest.mark.parametrize("d, fwd_rows, key_tile", [(128, 128, 128), (256, 128, 64), (512, 64, 64)])
def test_tables_follow_the_native_kernels_of_each_head_dim(d, fwd_rows, key_tile):
    # the native forward covers D = 128, 256, 512 (64-row tiles at 512), the native backward too
    # (128-key tiles at 128, 64-key tiles at 256 and 512)
    layout = DualKVLayout((300,), ((100, 50),))
    tables = kernel_tables(layout, d, 2, native=True)
    rows = tables.fwd_tiles[:, 1] - tables.fwd_tiles[:, 0]
    assert rows.max().item() == fwd_rows
    keys = (tables.kv_items[:, 1] - tables.kv_items[:, 0]).max().item()
    assert keys == key_tile


# a root, its first child (one packed range with it) and that child's child; a second child of the
# root and its child, whose path is two pieces ([0, 300) and [450, 530))
TREE = TreeLayout((300, 100, 50, 80, 40), (-1, 0, 1, 0, 3), pad_len=6)
CHAIN = TreeLayout((300, 100, 50, 20), (-1, 0, 1, 1))  # every path one packed range


def levels_tree(prompt, levels, pad_len=0):
    """A prompt, then per level ``(branching, segment length)`` (the shape of tools/bench_attention.py's
    tree workloads): every segment's children follow it in DFS order, so a path is one piece per
    branch taken after a first child's."""
    lens, parents = [prompt], [-1]

    def grow(parent, depth):
        if depth == len(levels):
            return
        branching, length = levels[depth]
        for _ in range(branching):
            lens.append(length)
            parents.append(parent)
            grow(len(lens) - 1, depth + 1)

    grow(0, 0)
    return TreeLayout(tuple(lens), tuple(parents), pad_len=pad_len)


# (a) agent episodes: a prompt, 4 first turns, each continued twice; (b) a tree search branching at
# every level; block-sized and odd segments (partial last blocks of every piece at every head dim)
AGENT = levels_tree(1000, ((4, 256), (2, 500)), pad_len=5)
SEARCH = levels_tree(500, ((4, 130), (3, 129), (2, 65)))
# a second child at every level: paths of up to 6 pieces, segments of one token, a piece shorter
# than a key block, one ending a block early and one a key past it
DEEP = TreeLayout((200, 1, 130, 1, 64, 129, 5, 300, 1, 77, 33, 127, 1),
                  (-1, 0, 0, 2, 2, 4, 4, 6, 7, 7, 9, 9, 11), pad_len=3)


class NativeBuild:
    """The built extension, on the CPU: records each forward call after the checks the binding
    (csrc/dualkv_sm90.cpp) makes of its tables and outputs. ``pieces=False``: a build of sources
    from before multi-range tiles (an A/B against an older revision)."""

    def __init__(self, pieces: bool = True):
        self.calls = []
        if pieces:
            self.fwd_pieces = self._fwd_pieces

    def fwd(self, q, k, v, tiles, out, lse, sm_scale, window):
        self._check(q, out, lse, tiles, 5)
        self.calls.append(("fwd", tiles, None, sm_scale, window))

    def _fwd_pieces(self, q, k, v, tiles, pieces, out, lse, sm_scale, window):
        self._check(q, out, lse, tiles, 6)
        assert pieces.dtype == torch.int32 and pieces.dim() == 2 and pieces.shape[1] == 3 and pieces.is_contiguous()
        rows = tiles[:, 4:6]  # (piece_lo, piece_hi): ranges of the piece table
        assert (rows[:, 0] <= rows[:, 1]).all() and rows.min() >= 0 and rows.max() <= pieces.shape[0]
        self.calls.append(("fwd_pieces", tiles, pieces, sm_scale, window))

    @staticmethod
    def _check(q, out, lse, tiles, width):
        assert tiles.dtype == torch.int32 and tiles.dim() == 2 and tiles.shape[1] == width and tiles.is_contiguous()
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()


@pytest.mark.parametrize("d", [128, 256, 512])
def test_trees_of_several_ancestor_pieces_take_the_native_forward_where_it_is_built(d, monkeypatch):
    """A tree whose paths are several pieces gets multi-range tiles of the native forward's rows and
    the piece table, and the native backward the same items as a depth-1 layout would; a tree whose
    paths are single ranges keeps the single-range tiles; a build without ``fwd_pieces`` gets the
    Triton forward's tiles (its blocks)."""
    monkeypatch.setattr(sm90, "_extension", NativeBuild)
    assert kernels._native_backward(d, True)
    for layout in (TREE, DEEP):
        tables = kernel_tables(layout, d, 2, native=True, window_size=None if d == 512 else 100)
        assert tables.pieces is not None and tables.pieces.dtype == torch.int32 and tables.pieces.shape[1] == 3
        assert tables.fwd_tiles.dtype == torch.int32 and tables.fwd_tiles.shape[1] == 6
        assert (tables.fwd_tiles[:, 1] - tables.fwd_tiles[:, 0]).max().item() == kernels.NATIVE_FWD_BLOCK_M[d]
        assert (tables.kv_items[:, 1] - tables.kv_items[:, 0]).max().item() == kernels.NATIVE_BLOCK_N[d]
    chain = kernel_tables(CHAIN, d, 2, native=True)
    assert chain.pieces is None and chain.fwd_tiles.shape[1] == 5
    assert (chain.fwd_tiles[:, 1] - chain.fwd_tiles[:, 0]).max().item() == kernels.NATIVE_FWD_BLOCK_M[d]
    monkeypatch.setattr(sm90, "_extension", lambda: NativeBuild(pieces=False))
    assert not kernels._native_forward(d, True, multi_range_tiles=True) and kernels._native_forward(d, True)
    tables = kernel_tables(TREE, d, 2, native=True)
    triton_rows = kernel_config("fwd", d, TREE.device).block_m
    assert tables.fwd_tiles.shape[1] == 6
    assert (tables.fwd_tiles[:, 1] - tables.fwd_tiles[:, 0]).max().item() == triton_rows


@pytest.mark.parametrize("window", [None, 100])
def test_the_forward_hands_the_native_kernel_its_tables(window, monkeypatch):
    """Multi-range tiles go to ``fwd_pieces`` with their piece table, single-range ones (depth 1, and
    trees of single-range paths) to ``fwd``, the kernel they always took."""
    build = NativeBuild()
    monkeypatch.setattr(sm90, "_extension", lambda: build)
    for layout, kernel in ((TREE, "fwd_pieces"), (DEEP, "fwd_pieces"), (CHAIN, "fwd"),
                           (DualKVLayout((300,), ((100, 50),)), "fwd")):
        q, k, v = (torch.zeros(layout.total_tokens, h, 128, dtype=torch.bfloat16) for h in (8, 2, 2))
        tables = kernel_tables(layout, 128, 2, native=True, window_size=window)
        kernels._fwd(q, k, v, tables.fwd_tiles, tables.pieces, 0.125, window, None, native=True)
        name, tiles, pieces, scale, passed_window = build.calls[-1]
        assert name == kernel and tiles is tables.fwd_tiles and pieces is tables.pieces
        assert scale == 0.125 and passed_window == (window or 0)


@hopper
@pytest.mark.parametrize("d", [128, 256, 512])
@pytest.mark.parametrize("layout", [TREE, CHAIN, DEEP], ids=["pieces", "chain", "deep"])
@pytest.mark.parametrize("window", [None, 100])
def test_trees(d, layout, window):
    """The default backend on trees: both native kernels, the forward on multi-range tiles where
    paths are several pieces."""
    if window is not None and d == 512:
        pytest.skip("the native kernels have no window at head dim 512")
    check_flash_style(layout.to("cuda"), 8, 2, d, torch.bfloat16, backend="auto", window_size=window)


@hopper
@pytest.mark.parametrize("d", [128, 256, 512])
@pytest.mark.parametrize("dtype, heads", [(torch.bfloat16, (8, 2)), (torch.float16, (6, 1)), (torch.bfloat16, (4, 4))])
def test_agent_episodes_and_tree_search(d, dtype, heads):
    for layout in (AGENT, SEARCH):
        check_flash_style(layout.to("cuda"), *heads, d, dtype, backend="auto")


@hopper
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("window", [1, 64, 200, 1000])
def test_tree_windows(d, window):
    """Windows shorter than a block, a block, between blocks, and longer than a path's pieces:
    pieces the host drops, pieces the kernel enters at a later block, segments that see only the
    end of their last piece."""
    for layout in (DEEP, AGENT):
        check_flash_style(layout.to("cuda"), 8, 2, d, torch.bfloat16, backend="auto", window_size=window)


@hopper
@given(trajectory_sets(max_groups=3, max_segment=400, max_segments=10, vocab=1000), st.sampled_from([128, 256, 512]),
       st.sampled_from([(8, 2), (4, 4), (6, 1), (16, 2)]), st.one_of(st.none(), st.integers(1, 600)))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_fuzzed_trees(trajectories, d, heads, window):
    layout = pack_trajectories(trajectories, pad_to_multiple_of=8).layout.to("cuda")
    check_flash_style(layout, *heads, d, torch.bfloat16, backend="auto", window_size=None if d == 512 else window)


def forward_instantiations(layout, d, window=None):
    """The (head dim, window, pieces) template arguments of the native forward kernels that one call
    launches, from the kernel names ``torch.profiler`` records (demangled or not)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(layout.total_tokens, h, d, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dualkv_attn_func(q, k, v, layout, window_size=window)
        torch.cuda.synchronize()
    found = set()
    for name in {e.name for e in prof.events()}:
        if match := re.search(r"fwd_kernel<[^,]+, (\d+), (true|false), (true|false)>", name):
            found.add((int(match[1]), match[2] == "true", match[3] == "true"))
        elif match := re.search(r"fwd_kernelI\w+?Li(\d+)ELb([01])ELb([01])E", name):
            found.add((int(match[1]), match[2] == "1", match[3] == "1"))
    return found


@hopper
@pytest.mark.parametrize("d", [128, 256, 512])
def test_depth1_tables_keep_their_kernel(d):
    """Single-range tables (depth 1, trees of single-range paths) launch the depth-1 instantiation,
    whose machine code multi-range tiles left as it was; multi-range ones the PIECES instantiation."""
    window = None if d == 512 else 100
    depth1 = DualKVLayout((300,), ((100, 50),)).to("cuda")
    for layout, pieces in ((depth1, False), (CHAIN.to("cuda"), False), (TREE.to("cuda"), True)):
        assert forward_instantiations(layout, d) == {(d, False, pieces)}
        if window:
            assert forward_instantiations(layout, d, window) == {(d, True, pieces)}


@hopper
@pytest.mark.parametrize("d", [128, 256, 512])
def test_chosen_on_hopper(d):
    assert native_supported(*tensors(d, device="cuda"), None, None, False)
    assert native_supported(*tensors(d, device="cuda"), 100, None, False) == (d != 512)


@hopper
@pytest.mark.parametrize("d", [128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 1)])
def test_edge_layouts(dtype, heads, d):
    # P and R of 1, a prompt split into query chunks (fp32 partials), partial key tiles, padding
    layout = DualKVLayout((1, 3000, 130), ((1, 1, 5), (500,) * 6, (127, 1, 129, 64)), pad_len=7).to("cuda")
    check_flash_style(layout, *heads, d, dtype, backend="auto")


@hopper
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("window", [1, 64, 200, 1000])
def test_windows(d, window):
    """Windows shorter than a block, a block, between blocks, and longer than the responses: prompt
    blocks skipped by the forward, responses that see only the prompt's end, short responses whose
    window reaches past them (the tables' runs of positions)."""
    layout = DualKVLayout((1, 3000, 130), ((1, 1, 5), (500,) * 6, (127, 1, 129, 64)), pad_len=7).to("cuda")
    check_flash_style(layout, 8, 2, d, torch.bfloat16, backend="auto", window_size=window)


@hopper
@given(
    rollout_groups(max_groups=5, max_prompt=900, max_responses=8, max_response=300),
    st.sampled_from([(8, 2), (4, 4), (6, 1), (16, 2)]),
    st.sampled_from([torch.bfloat16, torch.float16]),
    st.sampled_from([128, 256, 512]),
    st.one_of(st.none(), st.integers(1, 1200)),
)
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_fuzzed_layouts(groups, heads, dtype, d, window):
    layout = pack_groups(groups, pad_to_multiple_of=8).layout.to("cuda")
    check_flash_style(layout, *heads, d, dtype, backend="auto", window_size=None if d == 512 else window)


def test_other_sources_build_under_their_own_name(monkeypatch, tmp_path):
    """DUALKV_NATIVE_SOURCES (tools/ab_native.py) names another csrc folder, built apart from ours."""
    from megatron_dualkv.ops.dualkv_attn_sm90 import CSRC, _sources

    monkeypatch.delenv("DUALKV_NATIVE_SOURCES", raising=False)
    assert _sources() == ("dualkv_sm90", CSRC)
    (tmp_path / "dualkv_sm90.cpp").write_text("")
    monkeypatch.setenv("DUALKV_NATIVE_SOURCES", str(tmp_path))
    name, folder = _sources()
    assert folder == tmp_path.resolve() and name.startswith("dualkv_sm90_") and name != "dualkv_sm90"
    monkeypatch.setenv("DUALKV_NATIVE_SOURCES", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no dualkv_sm90.cpp"):
        _sources()
