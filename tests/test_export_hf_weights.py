"""export_hf_weights (a live model's weights under their Hugging Face names, whole, one at a time)
against the Hugging Face checkpoint the model was converted from, in one process and on two gloo
processes at tp=2 (Qwen3, Gemma 3, Qwen3.5), ep=2 (Qwen3-MoE), pp=2 (Qwen3) and cp=2 (Qwen3.5),
where every rank must yield every tensor, and give transformers' log-probs; also for layer counts
pp=2 splits unevenly (Qwen3, Gemma 3) and a vocabulary tp pads. The parallel runs also save their model with save_model
(Megatron's own writer, each tensor split as the ranks hold it): loading that in one process and
converting it back to Hugging Face must be lossless."""
import json

import pytest
import torch

from checkpoint_worker import SCENARIOS, launch
from hf_checkpoints import CARDS, converted, safetensors_files  # noqa: F401
from megatron_dualkv.models import ModelCard, checkpoint_card, export_hf_weights, load_card, load_model, megatron_to_hf
from rollouts import make_batch, max_abs_diff
from test_hf_state_dicts import SHAPES, hf_response_logprobs


def assert_same_tensors(got, want):
    assert got.keys() == want.keys(), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].to(tensor.device), tensor), name


@pytest.mark.parametrize("name", CARDS)
def test_one_process_exports_the_hugging_face_tensors(converted, name):  # noqa: F811
    checkpoint = converted[name]
    model = load_model(checkpoint.megatron_dir)
    card = checkpoint_card(checkpoint.megatron_dir)
    exported = list(export_hf_weights(model, card))
    assert len({n for n, _ in exported}) == len(exported)
    assert_same_tensors(dict(exported), safetensors_files(checkpoint.hf_dir))
    assert_same_tensors(dict(export_hf_weights(model, card, naming="transformers")), checkpoint.hf.state_dict())


def test_a_card_that_does_not_fit_the_model_is_refused(converted):  # noqa: F811
    model = load_model(converted["gemma3-tiny"].megatron_dir)  # tied embeddings: no output layer
    card = load_card("gemma3-tiny")
    untied = ModelCard(card.name, {**card.config, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"has no tensors output_layer\.weight"):
        next(export_hf_weights(model, untied))
    with pytest.raises(ValueError, match="naming must be one of"):
        next(export_hf_weights(model, card, naming="vllm"))


@pytest.fixture(scope="module")
def parallel_runs(converted):  # noqa: F811
    root = converted[CARDS[0]].megatron_dir.parents[1]  # <root>/<card>/megatron, as the worker reads them
    launch(list(SCENARIOS), 2, root)
    return root


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on the CPU")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_parallel_ranks_export_and_save_losslessly(parallel_runs, converted, scenario, tmp_path):  # noqa: F811
    card, world, sizes = SCENARIOS[scenario]
    checkpoint = converted[card]
    files = safetensors_files(checkpoint.hf_dir)
    want = hf_response_logprobs(checkpoint.hf, make_batch(SHAPES))
    for rank in range(world):
        result = torch.load(parallel_runs / f"{scenario}.rank{rank}.pt")
        assert_same_tensors(result["exported"], files)
        assert max_abs_diff(result["logprobs"], want) < 1e-5, f"log-probs on rank {rank}"
    saved = parallel_runs / f"{scenario}.saved"
    record = json.loads((saved / "dualkv_checkpoint.json").read_text())
    assert record["written_by"] == "save_model"
    assert {k: record["parallel_sizes"][k] for k in ("tp", "pp", "ep")} == {"tp": 1, "pp": 1, "ep": 1, **{
        k: v for k, v in sizes.items() if k in ("tp", "pp", "ep")}}
    megatron_to_hf(saved, tmp_path / "hf", progress=False)
    assert_same_tensors(safetensors_files(tmp_path / "hf"), files)
    model = load_model(saved).eval()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids, torch.arange(13).expand(2, 13), None)[..., : model.unpadded_vocab_size]
        torch.testing.assert_close(logits, checkpoint.hf(ids).logits, rtol=1e-5, atol=1e-5)
