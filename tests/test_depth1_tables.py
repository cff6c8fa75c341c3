"""The depth-1 kernel tables, frozen: ``query_tiles`` and ``key_items`` of DualKV layouts as they were
before prefix trees (issue #31) generalised the table builders. The depth-1 kernels' speed depends on
these tables, so they must not move, for a DualKVLayout and for the same forest as a TreeLayout
(16 trajectories sharing one prompt): small layouts are stored whole, the benchmark's layouts as
digests (tests/data/depth1_tables.json)."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dualkv import DualKVLayout, Trajectory, TreeLayout, pack_trajectories
from megatron_dualkv.ops.dualkv_attn import key_items, query_tiles

FROZEN = json.loads((Path(__file__).parent / "data" / "depth1_tables.json").read_text())

SMALL = {
    "two-groups-pad": ((45, 3), ((20, 31, 1), (2,)), 5),
    "p1-r1-many": ((1, 33, 2, 1, 50), ((1,), (1, 40, 2), (3, 3, 3, 3), (20,), (1, 1)), 7),
    "window-responses": ((96,), ((40, 40, 40),), 0),
    "long-prompt": ((300,), ((50,) * 6,), 0),
    "compile-check": ((70,), ((33, 40),), 0),
}
LARGE = {  # tools/bench_attention.py's workloads
    "16x8192x1024": ((8192,), ((1024,) * 16,), 0),
    "32x8192x512": ((8192,), ((512,) * 32,), 0),
    "8x4096x4096": ((4096,), ((4096,) * 8,), 0),
}
QUERY_BLOCKS = (16, 64, 128)
# (block_n, block_m, num_kv_heads, sm_count, window)
SMALL_ITEMS = ((16, 16, 2, 4, None), (16, 16, 2, 4, 7), (32, 16, 1, 8, 24), (8, 4, 2, 132, 60), (64, 64, 8, 132, None))
LARGE_ITEMS = ((128, 64, 8, 132, None), (64, 64, 8, 132, None), (64, 64, 16, 132, 1024), (32, 32, 16, 132, 1024))


def as_tree(lengths) -> TreeLayout:
    """The DualKV layout's forest as a TreeLayout: each prompt a root, its responses its children."""
    prompt_lens, response_lens, pad = lengths
    lens, parents = [], []
    for p, rs in zip(prompt_lens, response_lens):
        parents += [-1] + [len(lens)] * len(rs)
        lens += [p, *rs]
    return TreeLayout(tuple(lens), tuple(parents), pad)


def tables(layout, items_cases):
    """name -> int32 array of every table of one layout."""
    out = {f"tiles{m}": query_tiles(layout, m).numpy() for m in QUERY_BLOCKS}
    for n, m, heads, sms, window in items_cases:
        items, reduce, slots = key_items(layout, n, m, heads, sms, window)
        key = f"items{n}x{m}h{heads}s{sms}w{window}"
        out[key] = items.numpy()
        out[key + "-reduce"] = reduce.numpy()
        out[key + "-slots"] = np.asarray([slots], dtype=np.int32)
    return out


def digest(a: np.ndarray) -> str:
    return f"{a.shape}:" + hashlib.sha256(np.ascontiguousarray(a, dtype=np.int32).tobytes()).hexdigest()


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("name", SMALL)
def test_small_layouts_keep_their_tables(name, tree):
    got = tables(as_tree(SMALL[name]) if tree else DualKVLayout(*SMALL[name]), SMALL_ITEMS)
    assert sorted(got) == sorted(FROZEN["small"][name])
    for key, table in got.items():
        assert table.tolist() == FROZEN["small"][name][key], key


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("name", LARGE)
def test_benchmark_layouts_keep_their_tables(name, tree):
    got = tables(as_tree(LARGE[name]) if tree else DualKVLayout(*LARGE[name]), LARGE_ITEMS)
    assert {key: digest(t) for key, t in got.items()} == FROZEN["large"][name]


def test_depth_one_trajectories_keep_the_tables():
    """16 trajectories of one 8192-token prompt and 1024 tokens each, packed by pack_trajectories."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (8192,), generator=g)
    responses = [torch.cat([torch.tensor([1000 + i]), torch.randint(0, 1000, (1023,), generator=g)]) for i in range(16)]
    trajectories = [Trajectory(torch.cat([prompt, response])) for response in responses]
    layout = pack_trajectories(trajectories).layout
    assert layout.segment_lens == (8192,) + (1024,) * 16
    got = tables(layout, LARGE_ITEMS)
    assert {key: digest(t) for key, t in got.items()} == FROZEN["large"]["16x8192x1024"]
