"""Activation recompute (megatron_dualkv.mcore.recompute, build_model(recompute=...)).

Every mode must give the losses, log-probs and parameter gradients of a separately built model
without recompute and the same weights, through Megatron's schedule with a GRPO loss; selective
recompute must free exactly the norm outputs, rotated q and k and MLP activations it promises
(counted from the tensors autograd saved), and the settings no layer can run must be refused. The parallel runs (TP+SP, PP, CP, EP) are
scenarios of tests/distributed_worker.py.
"""
import functools
import math
import weakref

import pytest
import torch
import torch.nn.functional as F

from megatron_dualkv.mcore import transformer_engine_available
from megatron_dualkv.mcore.recompute import RECOMPUTE_MODES, checkpoint_without_output, recompute_config_kwargs
from megatron_dualkv.models import build_model, load_card
from megatron_dualkv.models.builder import _BLOCK_RECOMPUTE_PASSES_PADDING
from megatron_dualkv.rl import GRPOLoss, forward_backward
from megatron_dualkv.rl.logprobs import response_logprobs
from rollouts import make_batch, max_abs_diff, rl_micro_batches
from saved_tensors import saved_tensors

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="float32 on CPU; GPU: tests/test_recompute_gpu.py")

CARDS = ["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gemma4-tiny", "qwen3_5-tiny", "qwen3-next-tiny"]
MODES = [("selective", None), ("selective", 1), ("full", None), ("full", 1)]
SHAPES = [
    [(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1])],
    [(3, [1]), (9, [2, 7, 3, 1]), (2, [4])],
]
LOSS = GRPOLoss(clip_eps=0.2, kl_coef=0.05)


@pytest.mark.parametrize("mode, layers, expected", [
    (None, None, {}),
    ("none", None, {}),
    ("selective", None, dict(recompute_granularity="selective", recompute_modules=[], recompute_norms=True,
                             recompute_qk_norm_rope=True, recompute_activations=True)),
    ("selective", 3, dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3,
                          recompute_norms=True, recompute_qk_norm_rope=True, recompute_activations=True)),
    ("full", None, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ("full", 2, dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
])
def test_recompute_config_kwargs(mode, layers, expected):
    assert recompute_config_kwargs(mode, layers) == expected


@pytest.mark.parametrize("mode, layers, expected", [
    ("selective", None, dict(recompute_granularity="selective", recompute_modules=[], recompute_qk_norm_rope=True)),
    ("selective", 2, dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
                          recompute_qk_norm_rope=True)),
    ("full", None, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
])
def test_selective_recompute_under_fp8_recomputes_only_q_and_k(mode, layers, expected):
    assert recompute_config_kwargs(mode, layers, fp8=True) == expected


@pytest.mark.parametrize("mode, layers, match", [
    ("partial", None, "recompute must be one of"),
    ("selective", 0, "recompute_layers must be a positive int"),
    ("full", -1, "recompute_layers must be a positive int"),
    ("full", True, "recompute_layers must be a positive int"),
    ("full", "2", "recompute_layers must be a positive int"),
    ("none", 1, "recompute_layers=1 .* needs recompute='selective' or 'full'"),
    (None, 1, "recompute_layers=1 .* needs recompute='selective' or 'full'"),
])
def test_bad_recompute_settings(mode, layers, match):
    assert set(RECOMPUTE_MODES) == {"none", "selective", "offload", "full"}
    with pytest.raises(ValueError, match=match):
        recompute_config_kwargs(mode, layers)


def _load_balanced(card: str, layers) -> dict:
    """The card's MoE load-balancing loss, off where megatron-core 0.16's block recompute refuses it."""
    routed = bool(load_card(card).config.get("num_experts"))
    return dict(moe_aux_loss_coeff=0.0) if routed and layers and not _BLOCK_RECOMPUTE_PASSES_PADDING else {}


@functools.lru_cache(maxsize=None)
def reference(card: str, overrides: tuple, layout: str = "packed"):
    """The model without recompute, its micro-batches, and its GRPO step's outputs and gradients."""
    model = build_model(card, **dict(overrides))
    batches = rl_micro_batches(model, SHAPES)
    outputs, grads = grpo_step(model, batches, layout)
    return model, batches, outputs, grads


def grpo_step(model, batches, layout: str = "packed"):
    model.zero_grad(set_to_none=True)
    outputs = forward_backward(model, batches, LOSS, layout=layout, with_entropy=True)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


def check_same_step(card: str, overrides: dict, layout: str = "packed", **build_kwargs):
    """A GRPO step of the model built with ``build_kwargs`` equals the reference's, weight for weight."""
    ref_model, batches, ref_outputs, ref_grads = reference(card, tuple(sorted(overrides.items())), layout)
    model = build_model(card, **overrides, **build_kwargs)
    model.load_state_dict(ref_model.state_dict())
    outputs, grads = grpo_step(model, batches, layout)
    for got, want in zip(outputs, ref_outputs, strict=True):
        assert max_abs_diff(got.logprobs, want.logprobs) < 1e-6
        assert max_abs_diff(got.entropy, want.entropy) < 1e-6
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-7)
        for name in want.metrics:
            got_metric, want_metric = torch.cat(got.metrics[name]), torch.cat(want.metrics[name])
            torch.testing.assert_close(got_metric, want_metric, rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in ref_grads.items():
        # float32 noise: the recomputed norms' input gradients join the residual stream in another order
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)
    return model


@pytest.mark.parametrize("mode, layers", MODES, ids=[f"{m}{'+' + str(n) if n else ''}" for m, n in MODES])
@pytest.mark.parametrize("card", CARDS)
def test_recompute_gives_the_step_without_recompute(card, mode, layers):
    model = check_same_step(card, _load_balanced(card, layers), recompute=mode, recompute_layers=layers)
    config = model.config
    selective = mode == "selective"
    assert config.recompute_norms == config.recompute_qk_norm_rope == config.recompute_activations == selective


@pytest.mark.parametrize("card", ["qwen3-tiny", "gemma4-tiny"])
def test_selective_recompute_gives_the_step_without_recompute_on_the_replicated_layout(card):
    """sbhd: Megatron's RoPE without cu_seqlens, over a batch of right-padded sequences."""
    check_same_step(card, {}, layout="replicated", recompute="selective")


@pytest.mark.parametrize("card", ["qwen3-tiny", "gemma4-tiny"])
def test_qk_norm_rope_recompute_alone_gives_the_step_without_recompute(card):
    check_same_step(card, {}, recompute_qk_norm_rope=True)


def _attention_config(config, layer_number: int):
    """The config of the layer's attention (Gemma's full-attention layers have their own head dim and heads)."""
    return config.for_layer(layer_number) if hasattr(config, "for_layer") else config


def _is_linear_attention(config, layer_number: int) -> bool:
    """A Gated DeltaNet layer (Qwen3.5): no q to rotate."""
    return hasattr(config, "is_linear_attention") and config.is_linear_attention(layer_number)


def expected_release(config, num_tokens: int, layer_numbers) -> int:
    """float32 bytes of the norm outputs (2 per layer), the rotated q (attention layers), the gated
    norm's output (GDN layers) and MLP activations of these layers; not the GDN conv's output
    (``gdn_conv_release``).

    Of the rotated q and k only q: the CPU's attention (Megatron's DotProductAttention, the reference
    DualKV attention) saves a repeat_interleave'd copy of k for GQA, not k."""
    if config.num_moe_experts:
        activations = num_tokens * config.moe_router_topk * config.moe_ffn_hidden_size  # each token routed topk times
    else:
        activations = num_tokens * config.ffn_hidden_size
    rotated_queries = sum(config.num_attention_heads * _attention_config(config, n).kv_channels for n in layer_numbers
                          if not _is_linear_attention(config, n))
    gated_norms = sum(config.linear_num_value_heads * config.linear_value_head_dim for n in layer_numbers
                      if _is_linear_attention(config, n))
    return 4 * (len(layer_numbers) * (2 * num_tokens * config.hidden_size + activations)
                + num_tokens * (rotated_queries + gated_norms))


def gdn_conv_release(measured, config, layer_numbers) -> int:
    """Released bytes counted in each GDN layer's mixer itself: its conv's output, freed once the
    delta rule has saved its views of it (the CPU's delta rule saves per-level slices, so the count
    is the first slice's), in every GDN layer of ``layer_numbers`` and nowhere else."""
    total = 0
    for n in range(1, config.num_layers + 1):
        entries = measured.by_module.get(f"decoder.layers.{n - 1}.self_attention", [])
        freed = [math.prod(shape) * dtype.itemsize for shape, dtype, nbytes in entries if nbytes == 0]
        assert bool(freed) == (n in layer_numbers and _is_linear_attention(config, n)), n
        total += sum(freed)
    return total


@pytest.mark.parametrize("card", CARDS)
def test_selective_recompute_frees_the_norm_outputs_and_activations(card):
    batch = make_batch([(40, [30, 20, 30])], pad_to_multiple_of=8)
    ref_model = build_model(card)
    measured = {}
    for mode, layers in [(None, None), *MODES]:
        model = build_model(card, recompute=mode, recompute_layers=layers, **_load_balanced(card, layers))
        model.load_state_dict(ref_model.state_dict())
        measured[mode, layers] = saved_tensors(model, batch)
    none, selective, selective_1 = measured[None, None], measured["selective", None], measured["selective", 1]
    config, tokens = ref_model.config, batch.num_tokens
    layers = range(1, config.num_layers + 1)
    assert selective.released == expected_release(config, tokens, layers) + gdn_conv_release(selective, config, layers)
    # layer 1 recomputed whole
    assert selective_1.released == (expected_release(config, tokens, layers[1:])
                                    + gdn_conv_release(selective_1, config, layers[1:]))
    assert none.released == measured["full", None].released == measured["full", 1].released == 0
    # what the recompute saves instead (the norms' inputs, fc1's output) was saved anyway
    assert selective.kept + selective.released <= none.kept
    assert measured["full", None].kept < selective_1.kept < selective.kept
    assert measured["full", None].kept < measured["full", 1].kept < none.kept


def qk_norm_rope_release(config, num_tokens: int, rotary_fraction: float = 1.0) -> tuple:
    """float32 bytes (kept, released) that recompute_qk_norm_rope frees in every layer, on the CPU.

    Kept no more: the q norm's input where the query reshape copies it (more than one key/value
    head; with one it is a view of linear_qkv's output, alive anyway), RoPE's cos and sin for q and
    k, the q/k norms' statistics and their normalised input: the CPU's unfused RMSNorm (torch's, and
    Gemma's reference one) saves it for the weight's gradient, and the zero-centred (Gemma 3) norm
    its ``1 + w``; fused GPU norms save neither. Released: the rotated q, which the CPU's attention
    saves as a view (of k it saves a copy, so the rotated k was never kept there). Attention layers
    only; rotary_fraction: the share of a head that RoPE rotates (cos and sin are that wide).
    """
    kept = released = 0
    for number in range(1, config.num_layers + 1):
        if _is_linear_attention(config, number):
            continue
        layer = _attention_config(config, number)
        heads, groups, d = layer.num_attention_heads, layer.num_query_groups, layer.kv_channels
        query_copy = heads * d if groups > 1 else 0
        normed = (heads + groups) * (d + 1)  # normalised input and statistics
        rope = 4 * int(d * rotary_fraction)
        kept += 4 * num_tokens * (query_copy + rope + normed) + (8 * d if config.layernorm_zero_centered_gamma else 0)
        released += 4 * num_tokens * heads * d
    return kept, released


@pytest.mark.parametrize("card", CARDS)
def test_selective_recompute_frees_the_qk_norm_and_rope_tensors(card):
    batch = make_batch([(40, [30, 20, 30])], pad_to_multiple_of=8)
    ref_model = reference(card, ())[0]
    measured = {}
    for qk_norm_rope in (False, True):
        model = build_model(card, **{**recompute_config_kwargs("selective"), "recompute_qk_norm_rope": qk_norm_rope})
        model.load_state_dict(ref_model.state_dict())
        measured[qk_norm_rope] = saved_tensors(model, batch)
    rope = load_card(card).config.get("rope_parameters") or {}
    kept, released = qk_norm_rope_release(ref_model.config, batch.num_tokens, rope.get("partial_rotary_factor", 1.0))
    assert measured[True].released - measured[False].released == released
    assert measured[False].kept - measured[True].kept == kept + released
    assert not any(name.endswith(("q_layernorm", "k_layernorm")) for name in measured[True].by_module)


def test_layers_recomputed_whole_run_their_norms_and_activation_once_more():
    """selective + 1: layer 1 is Megatron's to recompute (no-grad forward, then once in the backward),
    layer 2 recomputes its norms (the q/k norms with RoPE) and activation once in the backward;
    neither computes anything a third time."""
    model = build_model("qwen3-tiny", recompute="selective", recompute_layers=1)
    calls = []
    for number, layer in enumerate(model.decoder.layers, start=1):
        attention = layer.self_attention
        # the attention's _rotated norms and rotates q, then k
        for module, method in ((layer.input_layernorm, "compute"), (attention, "_rotated"),
                               (layer.pre_mlp_layernorm, "compute"), (layer.mlp, "activation")):
            original = getattr(module, method)
            setattr(module, method, functools.partial(_counted, calls, number, original))
    forward_backward(model, rl_micro_batches(reference("qwen3-tiny", ())[0], SHAPES[:1]), LOSS)
    assert sorted(calls) == [1] * 10 + [2] * 10  # per layer: 5 computations (q and k apart), each twice


def _counted(calls, number, function, *args):
    calls.append(number)
    return function(*args)


@pytest.mark.parametrize("card, module", [
    ("qwen3-tiny", "mlp"), ("gemma3-tiny", "mlp"), ("qwen3-tiny", "core_attn"), ("qwen3-moe-tiny", "moe"),
])
def test_megatron_module_recompute_runs_without_transformer_engine(card, module):
    """Megatron's own selective modules that checkpoint the ordinary way, as build_model overrides."""
    batch = make_batch()
    model = check_same_step(card, {}, recompute_granularity="selective", recompute_modules=[module])
    kept = saved_tensors(model, batch).kept
    reference_model = reference(card, ())[0]
    assert kept < saved_tensors(reference_model, batch).kept


@pytest.mark.parametrize("build_kwargs, match", [
    (dict(recompute="sometimes"), "recompute must be one of"),
    (dict(recompute="full", recompute_layers=3), r"recompute_layers \(recompute_num_layers\) = 3 is more than the 2"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4), "= 4 is more than the 2"),
    (dict(recompute="none", recompute_layers=1), "needs recompute='selective' or 'full'"),
    (dict(recompute="offload", recompute_layers=3), r"recompute_layers \(offload_layers\) = 3 is more than the 2"),
    (dict(recompute="selective", recompute_granularity="full"), "do not also pass recompute_granularity"),
    (dict(recompute="full", recompute_norms=True), "do not also pass recompute_norms"),
    (dict(recompute="selective", normalization="LayerNorm"), "recompute_norms: layer 1's input_layernorm is a Layer"),
    (dict(recompute_norms=True, normalization="LayerNorm"), "recompute_norms: layer 1's input_layernorm"),
    (dict(recompute_activations=True, bias_activation_fusion=True, activation_func=F.gelu, add_bias_linear=True),
     "recompute_activations: of Megatron's fused activations"),
])
def test_settings_no_layer_can_run_are_refused(build_kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model("qwen3-tiny", **build_kwargs)


def test_experts_off_the_grouped_path_are_refused():
    with pytest.raises(ValueError, match="recompute_activations: the experts' activation is recomputed on Grouped"):
        build_model("qwen3-moe-tiny", recompute="selective", add_bias_linear=True)


@pytest.mark.skipif(_BLOCK_RECOMPUTE_PASSES_PADDING, reason="megatron-core 0.17+ passes the padding mask")
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_block_recompute_with_load_balancing_is_refused_on_megatron_0_16(mode):
    with pytest.raises(ValueError, match="recompute_layers with MoE load balancing .* megatron-core < 0.17"):
        build_model("qwen3-moe-tiny", recompute=mode, recompute_layers=1)


@pytest.mark.skipif(transformer_engine_available(), reason="Megatron runs them with Transformer Engine")
@pytest.mark.parametrize("module", ["layernorm", "moe_act"])
def test_megatron_te_only_modules_are_refused_without_transformer_engine(module):
    with pytest.raises(ValueError, match=f"recompute_modules \\['{module}'\\]: Megatron-Core recomputes these through"):
        build_model("qwen3-moe-tiny", recompute_granularity="selective", recompute_modules=[module])


def _norm_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * weight  # its backward needs x and the weight, not the output


def _step(x, weight, linear, checkpointed: bool, released: bool):
    """linear(norm_like(x)) summed and backpropagated; the grads of x, weight and linear's weight."""
    for t in (x, weight, linear.weight):
        t.grad = None
    if checkpointed:
        y, release = checkpoint_without_output(functools.partial(_norm_like, weight=weight), x)
    else:
        y = _norm_like(x, weight)
    z = linear(y)
    if checkpointed and released:
        release(z)
        assert y.untyped_storage().nbytes() == 0
        storage_at_backward = []
        z.register_hook(lambda grad: storage_at_backward.append(y.untyped_storage().nbytes()))
    (z * torch.arange(z.numel(), dtype=z.dtype).view_as(z)).sum().backward()
    if checkpointed and released:
        assert storage_at_backward == [y.numel() * y.element_size()]  # recomputed before the consumer's backward
    return x.grad.clone(), weight.grad.clone(), linear.weight.grad.clone()


@pytest.mark.parametrize("released", [True, False], ids=["released", "kept"])
def test_checkpoint_without_output_gives_autograd_gradients(released):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(8, generator=g, dtype=torch.float64))
    linear = torch.nn.Linear(8, 3, dtype=torch.float64)
    want = _step(x, weight, linear, checkpointed=False, released=False)
    got = _step(x, weight, linear, checkpointed=True, released=released)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_restored_output_is_freed_with_its_consumers_saved_input():
    """The restore hook lives as long as the graph; the recomputed output must not: it goes once
    its consumer's backward has read it, while later layers' backward still runs."""
    x = torch.randn(6, 8, requires_grad=True)
    linear = torch.nn.Linear(8, 3)
    y, release = checkpoint_without_output(torch.tanh, x)
    z = linear(y)
    release(z)
    alive = weakref.ref(y)
    del y, release
    loss = z.sum()
    loss.backward()
    assert alive() is None and loss.grad_fn is not None


def test_a_retained_graph_backpropagates_twice_through_a_released_output():
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    linear = torch.nn.Linear(8, 3, dtype=torch.float64)
    y, release = checkpoint_without_output(torch.tanh, x)
    z = linear(y)
    release(z)
    loss = z.pow(2).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=1e-12)


def test_checkpoint_without_output_is_a_plain_call_without_autograd():
    x = torch.randn(4, 5)
    with torch.no_grad():
        y, release = checkpoint_without_output(torch.tanh, x.requires_grad_())
    release(y)
    assert y.grad_fn is None and y.untyped_storage().nbytes() == y.numel() * 4
    y, release = checkpoint_without_output(torch.tanh, torch.randn(4, 5), enabled=True)  # nothing requires grad
    assert y.grad_fn is None


def test_checkpoint_without_output_refuses_autograd_grad():
    x = torch.randn(4, 5, requires_grad=True)
    y, _ = checkpoint_without_output(torch.tanh, x)
    with pytest.raises(RuntimeError, match=r"need \.backward\(\), not torch.autograd.grad"):
        torch.autograd.grad(y.sum(), x)


def test_selective_recompute_leaves_inference_alone():
    """Without autograd nothing is checkpointed or released: log-probs as without recompute."""
    model = build_model("qwen3-tiny", recompute="selective")
    batch = make_batch()
    with torch.no_grad():
        got, _ = response_logprobs(model, batch)
        reference_model = reference("qwen3-tiny", ())[0]
        model.load_state_dict(reference_model.state_dict())
        got, _ = response_logprobs(model, batch)
        want, _ = response_logprobs(reference_model, batch)
    assert torch.equal(got, want)
