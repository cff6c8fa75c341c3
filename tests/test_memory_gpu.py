"""What one decoder layer keeps for its backward on the GPU, against the memory model's count
(``megatron_dualkv.memory.layer_activation_bytes``), with the measurement of
tools/probe_activation_memory.py: the memory allocated after a forward, one layer against two."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_dualkv.mcore import ParallelSizes, transformer_engine_available
from megatron_dualkv.memory import layer_activation_bytes, layer_linear_parameters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels' saved tensors are the GPU's")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_activation_memory.py"


def probe():
    spec = importlib.util.spec_from_file_location("probe_activation_memory", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPECS = [(False, None)] + [(True, None), (True, "e4m3")] * transformer_engine_available()


@pytest.mark.parametrize("transformer_engine, fp8", SPECS, ids=[f"te={te}-fp8={fp8}" for te, fp8 in SPECS])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("card", ["qwen3-4b", "gemma3-4b"])
def test_one_layer_keeps_what_the_model_counts(card, mode, transformer_engine, fp8):
    tool, tokens, spec = probe(), 8192, dict(transformer_engine=transformer_engine, fp8=fp8)
    one, _ = tool.held_after_forward(card, 1, mode, tokens, torch.bfloat16, **spec)
    two, config = tool.held_after_forward(card, 2, mode, tokens, torch.bfloat16, **spec)
    predicted = layer_activation_bytes(config, 2, ParallelSizes(), mode, "packed", transformer_engine, fp8 is not None)
    if fp8 and mode != "full":  # the layer's FP8 weights, kept per micro-batch (MemoryModel.fp8_weight_bytes)
        predicted += 2 * layer_linear_parameters(config, 2, ParallelSizes()).total / tokens
    assert (two - one) / tokens == pytest.approx(predicted, rel=0.05)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("layer", [2, 4], ids=["gated-delta-net", "gated-attention"])
def test_a_hybrid_layer_keeps_what_the_model_counts(layer, mode):
    """Qwen3.5-4B's Gated DeltaNet layer (2) and full-attention layer with an output gate (4): the
    model of ``layer`` layers against the one of ``layer - 1``."""
    tool, tokens = probe(), 8192
    fewer, _ = tool.held_after_forward("qwen3_5-4b", layer - 1, mode, tokens, torch.bfloat16)
    more, config = tool.held_after_forward("qwen3_5-4b", layer, mode, tokens, torch.bfloat16)
    predicted = layer_activation_bytes(config, layer, ParallelSizes(), mode, "packed")
    assert (more - fewer) / tokens == pytest.approx(predicted, rel=0.05)
