"""Hugging Face <-> Megatron state dicts of every family (``ModelFamily.hf_to_megatron`` /
``megatron_to_hf``), against transformers' own models as the oracle: a tiny random-weight HF
model (built from its config class, no downloads) mapped onto ours gives the same logits on plain
sequences and the same per-response log-probs through the packed layout. A Qwen3 card with YaRN
RoPE runs the same tests, its positions past the original context."""
import importlib.util

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

from megatron_dualkv.models import FAMILIES, ModelCard, build_model, load_card, load_megatron_state_dict
from megatron_dualkv.rl import forward_logprobs
from rollouts import device_of, make_batch, max_abs_diff

HF_MODELS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    "gemma4_text": (Gemma4TextConfig, Gemma4ForCausalLM),
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}
# prompts longer than the Gemma cards' sliding window of 6
SHAPES = [(9, [3, 1, 7]), (2, [5, 2]), (13, [6, 1])]
# YaRN as Qwen3 cards take it, scaled down: a context of 8 stretched 4 times, so most positions of
# SHAPES and of the 21-token sequences lie past the original context
QWEN3_YARN = ModelCard("qwen3-yarn-tiny", {
    **load_card("qwen3-tiny").config, "name": "qwen3-yarn-tiny", "max_position_embeddings": 32, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
})
TEST_CARDS = {card.name: card for card in [QWEN3_YARN]}


def card_named(name):
    return TEST_CARDS.get(name) or load_card(name)


def skip_unless_hf_runs_on_the_cpu(hf) -> None:
    """transformers before 5.25 hands Qwen3.5 / Qwen3-Next's gated delta rule to fla-core whenever
    it is installed, CPU tensors too, which its kernels cannot read; 5.25 keeps CPU inputs on its
    PyTorch path, the oracle these tests want."""
    if (hf.config.model_type in ("qwen3_5_text", "qwen3_next") and importlib.util.find_spec("fla") is not None
            and Version(transformers.__version__) < Version("5.25")):
        pytest.skip(f"transformers {transformers.__version__} runs {hf.config.model_type} on the CPU through "
                    "fla-core's GPU kernels (fixed in 5.25)")


def hf_model(card):
    """Random weights, every tensor moved off its initial value (norms off 0 or 1, Gemma 4's
    layer scalars off 1) so that a wrong mapping cannot hide behind an identity."""
    config_class, model_class = HF_MODELS[card.model_type]
    config = config_class(**{k: v for k, v in card.config.items() if k not in ("name", "source", "model_type")})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny", "gemma3-tiny", "gemma4-tiny", "qwen3_5-tiny",
                                                 "qwen3-next-tiny", QWEN3_YARN.name])
def models(request):
    card = card_named(request.param)
    hf = hf_model(card)
    return card, hf, ours_of(card, hf)


def ours_of(card, hf, **overrides):
    """Our model of ``card`` with the weights of the transformers model ``hf`` (moved to our device)."""
    ours = build_model(card, **overrides).eval()
    hf.to(device_of(ours))
    load_megatron_state_dict(ours, FAMILIES[card.model_type].hf_to_megatron(card, ours.config, hf.state_dict()))
    return ours


def test_round_trip_is_bitwise(models):
    card, hf, ours = models
    family, hf_state = FAMILIES[card.model_type], hf.state_dict()
    back = family.megatron_to_hf(card, ours.config, family.hf_to_megatron(card, ours.config, hf_state))
    assert back.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    from_model = family.megatron_to_hf(card, ours.config, ours.state_dict())
    assert all(torch.equal(from_model[name], tensor) for name, tensor in hf_state.items())


def test_logits_equal_the_hugging_face_model(models):
    _, hf, ours = models
    ids = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(1)).to(device_of(ours))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids, torch.arange(21, device=ids.device).expand(3, 21), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def hf_response_logprobs(hf, batch):
    """Per group, per response: the log-probs transformers gives the response after its own prompt copy."""
    rep = batch.replicated()
    sequences = iter(rep.split(rep.tokens))
    want = []
    with torch.no_grad():
        for p, responses in zip(batch.layout.prompt_lens, batch.layout.response_lens):
            group = []
            for r in responses:
                sequence = next(sequences)
                logprobs = torch.log_softmax(hf(sequence[None]).logits[0], -1)
                group.append(logprobs[p - 1 : p - 1 + r].gather(-1, sequence[p:, None])[:, 0])
            want.append(group)
    return want


def test_packed_logprobs_equal_the_hugging_face_model(models):
    """Each response after its own prompt copy through transformers == the packed micro-batch through ours."""
    _, hf, ours = models
    batch = make_batch(SHAPES).to(device_of(ours))
    with torch.no_grad():
        got = forward_logprobs(ours, batch)
    assert max_abs_diff(got, hf_response_logprobs(hf, batch)) < 1e-5


@pytest.mark.parametrize("dropped", ["rope_scaling", "attention factor"])
def test_the_comparisons_see_a_dropped_yarn(dropped):
    """Our YaRN model without its scaling (plain RoPE), or without YaRN's attention factor (mscale
    1), is far from transformers' beyond the tolerance above, on plain and packed sequences alike."""
    hf = hf_model(QWEN3_YARN)
    if dropped == "rope_scaling":
        ours = ours_of(ModelCard("plain", {**QWEN3_YARN.config, "rope_scaling": None}), hf)
    else:  # mscale / mscale_all_dim of 0: Megatron's factor (0.1 * 0 * ln 4 + 1) / (0.1 * 0 * ln 4 + 1) = 1
        ours = ours_of(QWEN3_YARN, hf, yarn_mscale=0.0, yarn_mscale_all_dim=0.0)
    ids = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(1)).to(device_of(ours))
    batch = make_batch(SHAPES).to(device_of(ours))
    with torch.no_grad():
        logits = (ours(ids, torch.arange(21, device=ids.device).expand(3, 21), None) - hf(ids).logits).abs().max()
        logprobs = max_abs_diff(forward_logprobs(ours, batch), hf_response_logprobs(hf, batch))
    assert logits > 1e-3 and logprobs > 1e-3, (logits, logprobs)


def test_state_dicts_that_do_not_fit_are_refused(models):
    card, hf, ours = models
    family, hf_state = FAMILIES[card.model_type], hf.state_dict()
    with pytest.raises(ValueError, match=r"missing model\.norm\.weight"):
        family.hf_to_megatron(card, ours.config, {k: v for k, v in hf_state.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match=r"unexpected model\.extra\.weight"):
        family.hf_to_megatron(card, ours.config, {**hf_state, "model.extra.weight": torch.zeros(1)})
    q = next(name for name in hf_state if name.endswith("self_attn.q_proj.weight"))
    with pytest.raises(ValueError, match="does not split into"):
        family.hf_to_megatron(card, ours.config, {**hf_state, q: hf_state[q][:-1]})
    with pytest.raises(ValueError, match="missing decoder.final_layernorm.weight"):
        family.megatron_to_hf(card, ours.config, {k: v for k, v in ours.state_dict().items() if "final_layernorm" not in k})
    if "output_layer.weight" not in ours.state_dict():  # tied embeddings
        with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
            family.hf_to_megatron(card, ours.config, {**hf_state, "lm_head.weight": hf_state["lm_head.weight"] + 1})
