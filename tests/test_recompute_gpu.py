"""Activation recompute on the GPU: bf16 and the CUDA paths (compiled RMSNorm, Megatron's fused
SwiGLU, GroupedMMExperts' grouped matmuls on sm_90+, the Triton RMSNorm and GeGLU of Gemma, the
DualKV kernels, which save the rotated q and k themselves), which the CPU tests
(tests/test_recompute.py, float32) do not run.

    python -m pytest -q -s tests/test_recompute_gpu.py

prints, per model, the bytes autograd keeps per token and layer in each mode, by module (``-s``).
"""
import re
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from megatron_dualkv.models import build_model, load_card
from megatron_dualkv.rl import GRPOLoss, forward_backward
from rollouts import make_batch, rl_micro_batches
from saved_tensors import saved_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the tiny cards, and real widths (two layers) where the kernels take their production paths
MODELS = [
    ("qwen3-tiny", None), ("qwen3-moe-tiny", None), ("gemma3-tiny", None), ("gemma4-tiny", None),
    ("qwen3-8b", 2), ("qwen3-30b-a3b", 2), ("gemma3-27b", 2),
]
MODES = [(None, None), ("selective", None), ("selective", 1), ("full", None)]
SHAPES = [[(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1])], [(3, [1]), (9, [2, 7, 3, 1]), (2, [4])]]


def _card(name: str, num_layers):
    """The card, cut to its first ``num_layers`` layers (None: whole)."""
    card = load_card(name)
    if num_layers is None:
        return card
    return replace(card, name=f"{name}-{num_layers}l",
                   config={**card.config, "num_hidden_layers": num_layers, "max_window_layers": num_layers})


def _models(name, num_layers):
    """The model of each mode, all with the weights of the first (no recompute)."""
    card, models = _card(name, num_layers), {}
    for mode, layers in MODES:
        model = build_model(card, dtype=torch.bfloat16, recompute=mode, recompute_layers=layers)
        if models:
            model.load_state_dict(models[None, None].state_dict())
        models[mode, layers] = model
    return models


def _grpo_step(model, batches):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, batches, GRPOLoss(clip_eps=0.2, kl_coef=0.05))
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


@pytest.mark.parametrize("card, num_layers", MODELS[:4], ids=[card for card, _ in MODELS[:4]])
def test_recompute_gives_the_step_without_recompute_in_bf16(card, num_layers):
    """Up to bf16 rounding: the norms' forward runs without autograd (torch's kernel rather than the
    compiled one), and gradients are summed in other orders."""
    models = _models(card, num_layers)
    batches = rl_micro_batches(models[None, None], SHAPES)
    ref_outputs, ref_grads = _grpo_step(models[None, None], batches)
    for key, model in models.items():
        outputs, grads = _grpo_step(model, batches)
        for got, want in zip(outputs, ref_outputs, strict=True):
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                torch.testing.assert_close(torch.cat(g), torch.cat(w), rtol=0, atol=0.05, msg=f"{key} log-probs")
        for name, want in ref_grads.items():
            error = (grads[name].float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
            assert error < 0.03, f"{key} {name}: relative gradient error {error:.3g}"


def _per_token_and_layer(measured, num_tokens: int, num_layers: int):
    """Bytes kept per token and layer by each layer module (layer numbers merged)."""
    table = defaultdict(int)
    for module, tensors in measured.by_module.items():
        if ".layers." in module:
            table[re.sub(r"\.layers\.\d+", ".layers.*", module)] += sum(nbytes for *_, nbytes in tensors)
    return {module: total / num_tokens / num_layers for module, total in sorted(table.items())}


def _rotated_query_key(config, layer_number: int) -> int:
    """Elements per token of the layer's rotated q and k, which the DualKV kernel saves as they are."""
    layer = config.for_layer(layer_number) if hasattr(config, "for_layer") else config
    return (layer.num_attention_heads + layer.num_query_groups) * layer.kv_channels


@pytest.mark.parametrize("card, num_layers", MODELS, ids=[card for card, _ in MODELS])
def test_selective_recompute_frees_the_norm_outputs_and_activations_in_bf16(card, num_layers):
    models = _models(card, num_layers)
    longest = min(2048, models[None, None].max_sequence_length)  # the tiny cards: 512 positions
    batch = make_batch([(longest // 2, [longest // 4, longest // 8, longest // 2])], pad_to_multiple_of=8)
    config, tokens = models[None, None].config, batch.num_tokens
    measured = {key: saved_tensors(model, batch) for key, model in models.items()}
    for key, result in measured.items():
        print(f"\n{card} {key}: kept {result.kept / tokens / config.num_layers:.0f} B/token/layer (all layers' "
              f"modules plus the rest of the model), released {result.released / tokens / config.num_layers:.0f}")
        for module, per_token in _per_token_and_layer(result, tokens, config.num_layers).items():
            print(f"    {module:60s} {per_token:10.1f}")
    if config.num_moe_experts:
        activations = tokens * config.moe_router_topk * config.moe_ffn_hidden_size
    else:
        activations = tokens * config.ffn_hidden_size
    per_layer = [2 * (2 * tokens * config.hidden_size + activations + tokens * _rotated_query_key(config, n))  # bf16
                 for n in range(1, config.num_layers + 1)]
    assert measured["selective", None].released == sum(per_layer)
    assert measured["selective", 1].released == sum(per_layer[1:])
    assert measured["selective", None].kept + measured["selective", None].released <= measured[None, None].kept
