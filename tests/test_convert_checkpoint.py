"""tools/convert_checkpoint.py, hf_to_megatron / megatron_to_hf and load_model, against transformers
as the oracle: tiny random-weight models of every family (built from their config classes,
saved with ``save_pretrained`` into several shards with an index; transformers 5 writes the
published naming, Qwen3-MoE experts one by one) converted to Megatron checkpoints give
transformers' logits and per-response log-probs, convert back bitwise, and whatever cannot be
converted is refused before any output folder appears."""
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_checkpoints import CARDS, CONVERT_SIZES, SHARD_SIZE, convert, converted, index_files, safetensors_files  # noqa: F401
from megatron_dualkv.models import hf_to_megatron, load_model, megatron_to_hf, save_model
from megatron_dualkv.models import hf_folder
from megatron_dualkv.rl import forward_logprobs
from rollouts import device_of, make_batch, max_abs_diff
from test_hf_state_dicts import QWEN3_YARN, SHAPES, hf_response_logprobs, skip_unless_hf_runs_on_the_cpu


@pytest.fixture(params=CARDS)
def checkpoint(request, converted):  # noqa: F811
    return converted[request.param]


def test_hugging_face_folders_are_sharded_with_published_names(converted):  # noqa: F811
    for c in converted.values():
        assert len(index_files(c.hf_dir)) >= 2, c.card.name
    names = safetensors_files(converted["qwen3-moe-tiny"].hf_dir)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert not any(name.endswith("gate_up_proj") for name in names)


def test_megatron_folder_records_what_it_was_made_for(checkpoint):
    record = json.loads((checkpoint.megatron_dir / "dualkv_checkpoint.json").read_text())
    assert record["written_by"] == "hf_to_megatron"
    sizes = {"tp": 1, "pp": 1, "ep": 1, "cp": 1, **CONVERT_SIZES[checkpoint.card.name]}
    assert record["parallel_sizes"] == {**sizes, "etp": sizes["tp"]}
    assert (checkpoint.megatron_dir / "config.json").read_bytes() == (checkpoint.hf_dir / "config.json").read_bytes()
    assert (checkpoint.megatron_dir / "generation_config.json").is_file()


def test_loaded_model_matches_hugging_face(checkpoint):
    model = load_model(checkpoint.megatron_dir).eval()
    ids = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(1))
    batch = make_batch(SHAPES)
    skip_unless_hf_runs_on_the_cpu(checkpoint.hf)
    want = hf_response_logprobs(checkpoint.hf, batch)  # the Hugging Face model stays on the CPU
    device = device_of(model)
    with torch.no_grad():
        logits = model(ids.to(device), torch.arange(21, device=device).expand(3, 21), None)
        real = logits[..., : model.unpadded_vocab_size]  # the padded columns are no token
        torch.testing.assert_close(real.cpu(), checkpoint.hf(ids).logits, rtol=1e-5, atol=1e-5)
        assert max_abs_diff(forward_logprobs(model, batch.to(device), layout="replicated"), want) < 1e-5
        assert max_abs_diff(forward_logprobs(model, batch.to(device)), want) < 1e-5


def test_round_trip_is_bitwise(checkpoint, tmp_path):
    back = tmp_path / "back"
    convert("megatron-to-hf", "--megatron", checkpoint.megatron_dir, "--out", back, "--max-shard-size", SHARD_SIZE)
    want, got = safetensors_files(checkpoint.hf_dir), safetensors_files(back)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert len(index_files(back)) >= 2
    assert (back / "config.json").read_bytes() == (checkpoint.hf_dir / "config.json").read_bytes()
    assert sorted(p.name for p in back.iterdir() if not p.name.endswith(".safetensors")) == [
        "config.json", "generation_config.json", "model.safetensors.index.json"
    ]
    skip_unless_hf_runs_on_the_cpu(checkpoint.hf)
    # transformers loads the folder as the model it came from. Its Qwen3-Next logits after a reload
    # are not bitwise reproducible (3e-7 apart, even between two reloads of one folder under
    # pytest-xdist; the tensors above are equal bitwise), so those agree to 1e-6
    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, checkpoint.hf(ids).logits, rtol=0,
                                   atol=1e-6 if checkpoint.card.model_type == "qwen3_next" else 0)


# ------------------------------------------------------------------------------ refusals


@pytest.fixture
def qwen3_folder(converted, tmp_path):  # noqa: F811
    """A copy of the Qwen3 folder to spoil; its tensors are in one file, rewritten by ``rewrite``."""
    folder = tmp_path / "hf"
    shutil.copytree(converted["qwen3-tiny"].hf_dir, folder)
    return folder


def rewrite(folder, change):
    """Replace the folder's shards by one model.safetensors holding ``change(tensors)``."""
    tensors = change(safetensors_files(folder))
    for path in list(folder.glob("model*.safetensors*")):
        path.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def set_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def without(name):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


Q = "model.layers.0.self_attn.q_proj.weight"
SPOILERS = {
    "unknown architecture": (
        lambda f: set_config(f, model_type="llama", architectures=["LlamaForCausalLM"]),
        r"unsupported model_type 'llama' \(architectures \['LlamaForCausalLM'\]\)",
    ),
    "missing tensor": (lambda f: rewrite(f, without("model.norm.weight")), r"missing model\.norm\.weight"),
    "unexpected tensor": (
        lambda f: rewrite(f, lambda t: {**t, "model.extra.weight": torch.zeros(3)}), r"unexpected model\.extra\.weight"
    ),
    "mismatched shape": (
        lambda f: rewrite(f, lambda t: {**t, "model.norm.weight": torch.zeros(65)}),
        r"make decoder\.final_layernorm\.weight of shape \(65,\), but the model of the card has \(64,\)",
    ),
    "query rows": (lambda f: rewrite(f, lambda t: {**t, Q: t[Q][:-1]}), "does not split into 2 key/value groups"),
    "mismatched gate and up": (
        lambda f: rewrite(f, lambda t: {**t, "model.layers.1.mlp.up_proj.weight": torch.zeros(128, 63)}),
        r"do not make \['decoder\.layers\.1\.mlp\.linear_fc1\.weight'\]",
    ),
    "not a checkpoint folder": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "no safetensors weights": (lambda f: rewrite(f, lambda t: t) or (f / "model.safetensors").unlink(), "neither model.safetensors"),
}


@pytest.mark.parametrize("case", SPOILERS)
def test_unconvertible_folders_are_refused_without_output(qwen3_folder, tmp_path, case):
    spoil, message = SPOILERS[case]
    spoil(qwen3_folder)
    with pytest.raises(ValueError, match=message):
        hf_to_megatron(qwen3_folder, tmp_path / "megatron", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("card, sizes, message", [
    ("qwen3-tiny", dict(tp=3), r"num_attention_heads \(4\) must be a multiple of tensor_model_parallel_size \(3\)"),
    ("qwen3-tiny", dict(pp=3), r"num_layers \(2\) is fewer than pp \(3\)"),
    ("qwen3-moe-tiny", dict(ep=3), r"num_moe_experts \(8\) is not divisible by ep \(3\)"),
])
def test_parallel_sizes_the_model_cannot_split_are_refused(converted, tmp_path, card, sizes, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        hf_to_megatron(converted[card].hf_dir, tmp_path / "megatron", progress=False, **sizes)
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_reports_a_refusal(qwen3_folder, tmp_path, capsys):
    set_config(qwen3_folder, model_type="llama")
    with pytest.raises(SystemExit) as exit_info:
        convert("hf-to-megatron", "--hf", qwen3_folder, "--out", tmp_path / "megatron")
    assert exit_info.value.code == 2
    assert "unsupported model_type 'llama'" in capsys.readouterr().err
    assert not (tmp_path / "megatron").exists()


def test_tied_embeddings_that_differ_are_refused(converted, tmp_path):  # noqa: F811
    folder = tmp_path / "hf"
    shutil.copytree(converted["gemma3-tiny"].hf_dir, folder)
    rewrite(folder, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_megatron(folder, tmp_path / "megatron", progress=False)
    assert not (tmp_path / "megatron").exists()


def test_an_existing_output_folder_is_refused(converted, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="already exists"):
        hf_to_megatron(converted["qwen3-tiny"].hf_dir, tmp_path, progress=False)
    with pytest.raises(ValueError, match="already exists"):
        megatron_to_hf(converted["qwen3-tiny"].megatron_dir, tmp_path, progress=False)


def test_a_failure_while_writing_leaves_no_folder(converted, tmp_path, monkeypatch):  # noqa: F811
    reads = []

    def failing_read(self, name):
        reads.append(name)
        if len(reads) == 20:
            raise OSError("disk gone")
        return original_read(self, name)

    original_read = hf_folder.HFWeights.tensor
    monkeypatch.setattr(hf_folder.HFWeights, "tensor", failing_read)
    with pytest.raises(OSError, match="disk gone"):
        hf_to_megatron(converted["qwen3-moe-tiny"].hf_dir, tmp_path / "megatron", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_megatron_checkpoint_of_another_model_is_refused(converted, tmp_path):  # noqa: F811
    folder = tmp_path / "megatron"
    shutil.copytree(converted["qwen3-tiny"].megatron_dir, folder)
    set_config(folder, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"missing decoder\.layers\.2\..*unexpected none"):
        megatron_to_hf(folder, tmp_path / "hf", progress=False)
    set_config(folder, num_hidden_layers=2, intermediate_size=64)
    with pytest.raises(ValueError, match=r"other shapes decoder\.layers\.0\.mlp\.linear_fc1\.weight \(256, 64\) \(expected \(128, 64\)\)"):
        megatron_to_hf(folder, tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["megatron"]


# ------------------------------------------------------------------------------ YaRN


def test_yarn_survives_the_round_trips(converted, tmp_path):  # noqa: F811
    """transformers 5 writes YaRN as rope_parameters (the conversions above keep its config.json);
    a card's transformers 4 rope_scaling goes out with save_model and megatron_to_hf unchanged, and
    transformers loads either folder as the YaRN model."""
    checkpoint = converted[QWEN3_YARN.name]
    written = json.loads((checkpoint.hf_dir / "config.json").read_text())["rope_parameters"]
    assert {k: written[k] for k in ("rope_type", "factor", "original_max_position_embeddings")} == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    saved, back = tmp_path / "saved", tmp_path / "back"
    save_model(load_model(checkpoint.megatron_dir), QWEN3_YARN, saved)
    megatron_to_hf(saved, back, progress=False)
    assert json.loads((back / "config.json").read_text())["rope_scaling"] == QWEN3_YARN.config["rope_scaling"]
    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    assert reloaded.config.rope_parameters["rope_type"] == "yarn"
    ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, checkpoint.hf(ids).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------ multimodal checkpoints


def test_the_text_decoder_of_a_multimodal_checkpoint(converted, tmp_path):  # noqa: F811
    """A Gemma 3 ForConditionalGeneration-style folder as published: text config under
    ``text_config`` without the fields that take transformers' defaults, the text decoder's tensors
    under ``model.language_model.``, a vision tower beside it."""
    text = converted["gemma3-tiny"]
    folder, out = tmp_path / "multimodal", tmp_path / "megatron"
    folder.mkdir()
    text_config = json.loads((text.hf_dir / "config.json").read_text())
    del text_config["vocab_size"]
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text_config,
              "vision_config": {"model_type": "siglip_vision_model"}}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("model.", "model.language_model.", 1): t for name, t in safetensors_files(text.hf_dir).items()}
    save_file({**tensors, "model.vision_tower.patch_embedding.weight": torch.zeros(4, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"multimodal model 'gemma3'.*text_only=True \(--text-only\)"):
        hf_to_megatron(folder, out, progress=False)
    with pytest.raises(ValueError, match="lacks the required field 'vocab_size'"):
        hf_to_megatron(folder, out, text_only=True, progress=False)
    with pytest.raises(ValueError, match="card 'qwen3-tiny' describes a 'qwen3' model"):
        hf_to_megatron(folder, out, text_only=True, card="qwen3-tiny", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multimodal"]
    convert("hf-to-megatron", "--hf", folder, "--out", out, "--text-only", "--card", "gemma3-tiny")
    assert json.loads((out / "dualkv_checkpoint.json").read_text())["left_out"] == ["model.vision_tower"]
    convert("megatron-to-hf", "--megatron", out, "--out", tmp_path / "text")
    got, want = safetensors_files(tmp_path / "text"), safetensors_files(text.hf_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    written = json.loads((tmp_path / "text" / "config.json").read_text())
    assert written["model_type"] == "gemma3_text" and written["vocab_size"] == 256 and "source" not in written


def test_the_text_decoder_of_a_multimodal_qwen3_5_checkpoint(converted, tmp_path, capsys):  # noqa: F811
    """A Qwen3_5ForConditionalGeneration folder (transformers' save_pretrained, a tiny vision tower)
    holding qwen3_5-tiny's text weights, plus a shard of multi-token-prediction tensors as the
    published ones have: its text decoder converts to the weights of the text-only folder, bitwise,
    which export back under the text model's names."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from megatron_dualkv.models import checkpoint_card, export_hf_weights
    from megatron_dualkv.models.hf_folder import hf_card

    text = converted["qwen3_5-tiny"]
    folder, out = tmp_path / "multimodal", tmp_path / "megatron"
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=text.hf.config.hidden_size,
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    multimodal = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.hf.config.to_dict(), vision_config=vision))
    multimodal.model.language_model.load_state_dict(text.hf.model.state_dict())
    multimodal.lm_head.load_state_dict(text.hf.lm_head.state_dict())
    multimodal.save_pretrained(folder, max_shard_size=SHARD_SIZE)
    mtp = {"mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)}
    save_file(mtp, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    hf_to_megatron(folder, out, text_only=True, progress=False)
    visual = sum(name.startswith("model.visual.") for name in multimodal.state_dict())
    assert capsys.readouterr().out == (f"{folder}: converting the text decoder, leaving out model.visual, mtp "
                                       f"({visual + len(mtp)} tensors)\n")
    assert json.loads((out / "dualkv_checkpoint.json").read_text())["left_out"] == ["model.visual", "mtp"]
    got, want = load_model(out).state_dict(), load_model(text.megatron_dir).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want if torch.is_tensor(want[k]))
    exported = dict(export_hf_weights(load_model(out), checkpoint_card(out)))
    published = safetensors_files(text.hf_dir)
    assert exported.keys() == published.keys() and all(torch.equal(exported[k].cpu(), published[k]) for k in published)

    # transformers ties the composite model's lm_head by its top-level flag, whatever text_config says
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"] = True, False
    (folder / "config.json").write_text(json.dumps(config))
    card, _ = hf_card(folder, text_only=True)
    assert card.model_type == "qwen3_5_text" and card.config["tie_word_embeddings"] is True
