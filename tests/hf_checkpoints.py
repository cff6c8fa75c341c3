"""Hugging Face checkpoint folders of tiny random-weight transformers models (``save_pretrained``,
no downloads), converted once per test session with ``tools/convert_checkpoint.py``; shared by
test_convert_checkpoint.py and test_export_hf_weights.py."""
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest
import torch
from safetensors import safe_open

from megatron_dualkv.models import ModelCard, load_card
from test_hf_state_dicts import QWEN3_YARN, hf_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import convert_checkpoint  # noqa: E402

# Real depths and vocabularies at test size: layer counts pp=2 splits unevenly (Gemma's sliding and
# full layers across the split) and 300 tokens, padded to 384 rows in one process, 512 at tp=2.
UNEVEN_CARDS = {
    "qwen3-uneven": ModelCard("qwen3-uneven", {**load_card("qwen3-tiny").config, "num_hidden_layers": 3,
                                               "max_window_layers": 3, "vocab_size": 300}),
    "gemma3-uneven": ModelCard("gemma3-uneven", {**load_card("gemma3-tiny").config, "num_hidden_layers": 5,
                                                 "vocab_size": 300}),
}
# and YaRN RoPE, whose rope parameters the config.json of both directions keeps
TEST_CARDS = {**UNEVEN_CARDS, QWEN3_YARN.name: QWEN3_YARN}
CARDS = ["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gemma4-tiny", "qwen3_5-tiny", "qwen3-next-tiny", *TEST_CARDS]
# the parallel sizes each checkpoint is converted for (Gemma 4's one global key/value head allows no tp)
CONVERT_SIZES = {
    "qwen3-tiny": dict(tp=2, pp=2), "qwen3-moe-tiny": dict(ep=2), "gemma3-tiny": dict(tp=2), "gemma4-tiny": {},
    "qwen3_5-tiny": dict(tp=2), "qwen3-next-tiny": dict(ep=2),
    "qwen3-uneven": dict(tp=2, pp=2), "gemma3-uneven": dict(pp=2), QWEN3_YARN.name: {},
}
SHARD_SIZE = "100KB"  # several shards with an index, as published checkpoints come


@dataclass
class Converted:
    card: object  # ModelCard
    hf: torch.nn.Module
    hf_dir: Path
    megatron_dir: Path


def safetensors_files(folder: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = handle.get_tensor(name)
    return tensors


def index_files(folder: Path) -> set:
    return set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())


def convert(*args) -> None:
    convert_checkpoint.main([str(a) for a in args])


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Dict[str, Converted]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name in CARDS:
        card = TEST_CARDS.get(name) or load_card(name)
        hf = hf_model(card)
        hf_dir, megatron_dir = root / name / "hf", root / name / "megatron"
        hf.save_pretrained(hf_dir, max_shard_size=SHARD_SIZE)
        sizes = [f"--{k}={v}" for k, v in CONVERT_SIZES[name].items()]
        convert("hf-to-megatron", "--hf", hf_dir, "--out", megatron_dir, *sizes)
        out[name] = Converted(card, hf, hf_dir, megatron_dir)
    return out
