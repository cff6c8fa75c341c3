"""Rollout files (megatron_dualkv.rollout_io): token ids, text and chat prompts through SentencePiece
and Hugging Face tokenizers (a small one trained here) against the tokenizers' own encodings, the
inference engine's log-probs, and every malformed input with its file and line."""
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from megatron_dualkv.rollout_io import RolloutFileError, load_tokenizer, read_rollouts
from rollouts import make_hf_tokenizer

SENTENCEPIECE = Path(__file__).resolve().parents[1] / "examples" / "data" / "tokenizer.model"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return make_hf_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tiny-bpe")


def write(tmp_path, *records, name="rollouts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": [1], "responses": [[2]], "rewards": [1.0]}\n{"prompt": [1], oops}', r"ids.jsonl:2: not valid JSON"),
        ('{"prompt": [1], "responses": [[2]]}', r":1: expected an object with 'prompt', 'responses' and 'rewards'"),
        ('{"prompt": [1], "responses": [], "rewards": []}', r":1: 'responses' must be a non-empty list"),
        ('{"prompt": [1], "responses": [[2], [3]], "rewards": [1.0]}', r":1: 'rewards' must be a list of 2 numbers"),
        ('{"prompt": [1], "responses": [[2], [300]], "rewards": [1, 0]}',
         r":1: response 1: token id 300 is outside the model's vocabulary \(vocab_size 256\)"),
        ('{"prompt": [-1], "responses": [[2]], "rewards": [1]}', r":1: prompt: token id -1 is outside"),
        ('{"prompt": [1.5], "responses": [[2]], "rewards": [1]}', r":1: prompt: token ids must be integers"),
        ('{"prompt": [], "responses": [[2]], "rewards": [1]}', r":1: prompt: expected a non-empty list"),
        ('{"prompt": "text", "responses": [[2]], "rewards": [1]}', r":1: a text or chat prompt needs text responses"),
        ('{"prompt": [{"role": "user"}], "responses": ["4"], "rewards": [1]}',
         r":1: chat messages must be objects with 'role' and 'content' strings"),
        ('{"prompt": [1], "responses": [[2, 3], [4]], "rewards": [1, 0], "logprobs": [[-1.0], [-0.5]]}',
         r"ids.jsonl:1: 'logprobs' of response 0 has 1 values, the response has 2 tokens"),
        ('{"prompt": [1], "responses": [[2]], "rewards": [1], "logprobs": [[-1.0], [-0.5]]}',
         r":1: 'logprobs' must be a list of 1 lists, one per response"),
        ('{"prompt": [1], "responses": [[2]], "rewards": [1], "logprobs": [[0.5]]}',
         r":1: 'logprobs' of response 0 must be finite numbers <= 0"),
        ('{"prompt": [1], "responses": [[2]], "rewards": [1], "logprobs": [[-1]]}\n{"prompt": [1], "responses": [[2]], "rewards": [1]}',
         r"ids.jsonl:2: 'logprobs' must be in every line or in none: the first line has them, this one lacks"),
        ("\n\n", r"no rollout groups"),
    ],
)
def test_malformed_rollouts_are_reported_with_their_line(tmp_path, line, message):
    path = tmp_path / "ids.jsonl"
    path.write_text(line)
    with pytest.raises(RolloutFileError, match=message):
        read_rollouts(path, 256, tokenizer_path=None)


def test_token_ids_and_logprobs_are_read_as_given(tmp_path):
    path = write(tmp_path, {"prompt": [1, 2], "responses": [[3, 4, 5], [6]], "rewards": [1, 0],
                            "logprobs": [[-0.5, -1, -2.25], [0]]})
    rollouts = read_rollouts(path, 256)
    (group,) = rollouts.groups
    assert (group.prompt, group.responses, group.rewards) == ([1, 2], [[3, 4, 5], [6]], [1.0, 0.0])
    assert [x.tolist() for x in rollouts.logprobs[0]] == [[-0.5, -1.0, -2.25], [0.0]]
    assert rollouts.logprobs[0][0].dtype == torch.float32
    assert read_rollouts(write(tmp_path, {"prompt": [1], "responses": [[2]], "rewards": [1]}), 256).logprobs is None


def test_text_rollouts_need_a_tokenizer_that_fits_the_vocabulary(tmp_path):
    path = write(tmp_path, {"prompt": "What is 2 + 2?", "responses": ["4", "5"], "rewards": [1, 0]}, name="text.jsonl")
    with pytest.raises(RolloutFileError, match=r"text.jsonl:1: text rollouts need a tokenizer \(--tokenizer\)"):
        read_rollouts(path, 256, tokenizer_path=None)
    with pytest.raises(RolloutFileError, match=r"tokenizer not found"):
        read_rollouts(path, 256, tokenizer_path=tmp_path / "missing.model")
    with pytest.raises(RolloutFileError, match=r"has 256 pieces, more than the model's vocab_size 100"):
        read_rollouts(path, 100, tokenizer_path=SENTENCEPIECE)
    (group,) = read_rollouts(path, 256, tokenizer_path=SENTENCEPIECE).groups
    assert group.prompt[0] == 1 and all(r[-1] == 2 for r in group.responses)  # <s> prompt, response </s>
    assert group.rewards == [1.0, 0.0]
    chat = write(tmp_path, {"prompt": [{"role": "user", "content": "2 + 2?"}], "responses": ["4"], "rewards": [1]})
    with pytest.raises(RolloutFileError, match=r":1: chat prompts need a Hugging Face tokenizer with a chat template"):
        read_rollouts(chat, 256, tokenizer_path=SENTENCEPIECE)


def test_hugging_face_tokenizer_folder_with_a_chat_template(tmp_path, hf_folder):
    """Text and chat prompts against the ``tokenizers`` encoding of the same strings (the chat
    template rendered by hand), responses with the folder's EOS token, log-probs of that length."""
    raw = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    eos = raw.token_to_id("<|im_end|>")
    question, answer = "Kofi has 35 coins and gets 8 more.", "He has 43 coins."
    path = write(tmp_path,
                 {"prompt": question, "responses": [answer], "rewards": [1]},
                 {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
                  "responses": [answer, "43"], "rewards": [1, 0.5]})
    text, chat = read_rollouts(path, 256, tokenizer_path=hf_folder).groups
    assert text.prompt == raw.encode(question).ids and text.responses == [raw.encode(answer, add_special_tokens=False).ids + [eos]]
    rendered = f"<|im_start|>system Be brief.<|im_end|><|im_start|>user {question}<|im_end|><|im_start|>assistant "
    assert chat.prompt == raw.encode(rendered, add_special_tokens=False).ids
    assert chat.prompt[0] == raw.token_to_id("<|im_start|>") and chat.responses[1] == raw.encode("43").ids + [eos]
    lengths = [len(r) for r in chat.responses]
    with_logprobs = write(tmp_path, {"prompt": [{"role": "user", "content": question}], "responses": [answer, "43"],
                                     "rewards": [1, 0], "logprobs": [[-1.0] * n for n in lengths]}, name="lp.jsonl")
    assert [len(x) for x in read_rollouts(with_logprobs, 256, hf_folder).logprobs[0]] == lengths
    short = write(tmp_path, {"prompt": question, "responses": [answer], "rewards": [1], "logprobs": [[-1.0]]}, name="short.jsonl")
    with pytest.raises(RolloutFileError, match=rf"short.jsonl:1: 'logprobs' of response 0 has 1 values, the response has {lengths[0]} tokens"):
        read_rollouts(short, 256, hf_folder)


def test_a_bare_tokenizer_json(tmp_path, hf_folder):
    """A tokenizer.json alone: its encoding, no EOS (the file names none) and no chat template."""
    tokenizer = load_tokenizer(hf_folder / "tokenizer.json", 256)
    raw = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    assert tokenizer.size == raw.get_vocab_size() == 200
    assert tokenizer.response_ids("He has 43 coins.") == raw.encode("He has 43 coins.").ids
    chat = write(tmp_path, {"prompt": [{"role": "user", "content": "2 + 2?"}], "responses": ["4"], "rewards": [1]})
    with pytest.raises(RolloutFileError, match=r":1: chat prompts need a chat template, and the tokenizer .*tokenizer.json has none"):
        read_rollouts(chat, 256, hf_folder / "tokenizer.json")
    with pytest.raises(RolloutFileError, match=r"has 200 pieces, more than the model's vocab_size 150"):
        load_tokenizer(hf_folder, 150)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutFileError, match=r"tokenizer .*empty: not a SentencePiece .model, tokenizer.json or tokenizer folder"):
        load_tokenizer(tmp_path / "empty", 256)
