"""Rollout batches with awkward shapes for the Megatron-Core and RL tests (uneven groups, a
one-token prompt, one-token responses, a group with a single response, and padding), and the
model-card helpers those tests share; a small Hugging Face tokenizer trained on the bundled corpus."""
from pathlib import Path

import torch

from megatron_dualkv import RolloutGroup, pack_groups

# (prompt length, response lengths) per group
UNEVEN_SHAPES = [(5, [3, 1, 4]), (1, [2, 5]), (7, [6, 1]), (3, [1])]


def make_groups(shapes=UNEVEN_SHAPES, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return [
        RolloutGroup(ids(p), [ids(r) for r in rs], torch.rand(len(rs), generator=g).round(decimals=1).tolist())
        for p, rs in shapes
    ]


def make_batch(shapes=UNEVEN_SHAPES, vocab=256, seed=0, pad_to_multiple_of=8):
    return pack_groups(make_groups(shapes, vocab, seed), pad_to_multiple_of=pad_to_multiple_of)


def perturbed(nested, scale, seed=0):
    """The same nested per-group, per-response tensors, detached, plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    return [[x.detach() + scale * torch.randn(x.shape, generator=g).to(x.device) for x in group] for group in nested]


def rl_micro_batches(model, shapes_per_batch):
    """One RLMicroBatch per shape list, with behaviour and reference log-probs near the model's own."""
    from megatron_dualkv.rl import RLMicroBatch, forward_logprobs

    out = []
    for seed, shapes in enumerate(shapes_per_batch):
        batch = make_batch(shapes, seed=seed)
        with torch.no_grad():
            current = forward_logprobs(model, batch)
        out.append(RLMicroBatch(batch, perturbed(current, 0.3, seed), perturbed(current, 0.1, seed + 10)))
    return out


def device_of(model) -> torch.device:
    """Where ``build_model`` put the model (the GPU when there is one): the tests' inputs go there."""
    return next(model.parameters()).device


def max_abs_diff(a, b):
    """Largest difference of two nested per-group, per-response tensor lists (compared on a's
    device; a response may have no values: a trajectory that trains no token)."""
    return max((x - y.to(x.device)).abs().max().item() if x.numel() else 0.0
               for ga, gb in zip(a, b) for x, y in zip(ga, gb))


def config_of(card, **overrides):
    """The float32 TransformerConfig build_model would make from ``card`` (no parallelism)."""
    from megatron_dualkv.mcore import ParallelSizes
    from megatron_dualkv.models import FAMILIES, build_transformer_config, load_card

    card = load_card(card)
    return build_transformer_config(card, FAMILIES[card.model_type], ParallelSizes(), torch.float32, False, overrides)


def model_kwargs_of(card):
    from megatron_dualkv.models import FAMILIES, load_card

    card = load_card(card)
    return FAMILIES[card.model_type].gpt_model_kwargs(card)


def parameter_count(card) -> int:
    """The parameters of the card's model (tp=1, the real vocabulary), built on the meta device."""
    from megatron_dualkv.models import load_card
    from megatron_dualkv.models.checkpoint import _meta_model

    return sum(p.numel() for p in _meta_model(load_card(card)).parameters())


CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.txt"
# Qwen's chat format without newlines (the tiny tokenizer's alphabet is the corpus's)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def make_hf_tokenizer(folder, vocab_size=200):
    """A Hugging Face tokenizer folder trained here (``tokenizers`` BPE on examples/data/corpus.txt,
    no download): tokenizer.json, and tokenizer_config.json naming the EOS token and a chat template.
    Returns the folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False)
    tokenizer.train([str(CORPUS)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>",
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
