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
    with pytest.raises(RolloutFileError, match=r"has 256 tokens, the model's vocabulary 100: it is another model's tokenizer"):
        read_rollouts(path, 100, tokenizer_path=SENTENCEPIECE)
    rollouts = read_rollouts(path, 256, tokenizer_path=SENTENCEPIECE)
    (group,) = rollouts.groups
    assert rollouts.tokenizer == SENTENCEPIECE
    assert group.prompt[0] == 1 and all(r[-1] == 2 for r in group.responses)  # <s> prompt, response </s>
    assert group.rewards == [1.0, 0.0]
    chat = write(tmp_path, {"prompt": [{"role": "user", "content": "2 + 2?"}], "responses": ["4"], "rewards": [1]})
    with pytest.raises(RolloutFileError, match=r":1: chat prompts need a Hugging Face tokenizer with a chat template"):
        read_rollouts(chat, 256, tokenizer_path=SENTENCEPIECE)


@pytest.mark.parametrize("vocab_size, fits", [(256, True), (256 + 1024, True), (256 + 1025, False), (255, False),
                                              (151_936, False)])
def test_a_tokenizer_fits_only_its_models_vocabulary(vocab_size, fits):
    """The 256-token sample tokenizer: in a vocabulary padded past it by at most 1,024 rows (as
    published configs pad theirs); not in a smaller one, nor in Qwen3's."""
    if fits:
        assert load_tokenizer(SENTENCEPIECE, vocab_size).size == 256
    else:
        with pytest.raises(RolloutFileError, match=rf"has 256 tokens, the model's vocabulary {vocab_size:,}: "
                                                   r"it is another model's tokenizer; pass the model's own \(--tokenizer\)"):
            load_tokenizer(SENTENCEPIECE, vocab_size)


def test_token_id_files_use_no_tokenizer(tmp_path):
    path = write(tmp_path, {"prompt": [1, 2], "responses": [[3]], "rewards": [1]})
    assert read_rollouts(path, 256, tokenizer_path=SENTENCEPIECE).tokenizer is None


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
    with pytest.raises(RolloutFileError, match=r"has 200 tokens, the model's vocabulary 150: it is another model's tokenizer"):
        load_tokenizer(hf_folder, 150)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutFileError, match=r"tokenizer .*empty: not a SentencePiece .model, tokenizer.json or tokenizer folder"):
        load_tokenizer(tmp_path / "empty", 256)


# ---------------------------------------------------------------------------------- trajectory lines
def test_trajectory_lines_of_token_ids(tmp_path):
    path = write(tmp_path, {"tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "reward": 1, "group": "a"},
                 {"tokens": [1, 2, 5], "reward": 0.5, "group": "a"}, {"tokens": [7, 8], "loss_mask": [True, False],
                                                                       "reward": 0, "group": 3})
    rollouts = read_rollouts(path, 256)
    assert rollouts.groups == [] and rollouts.logprobs is None
    assert [(t.tokens, t.loss_mask, t.reward, t.group) for t in rollouts.trajectories] == [
        ([1, 2, 3, 4], [0, 0, 1, 1], 1.0, "a"), ([1, 2, 5], None, 0.5, "a"), ([7, 8], [True, False], 0.0, 3)]


EPISODE = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Kofi has 35 coins and gets 8 more."},
           {"role": "assistant", "content": "calculator: 35 + 8"}, {"role": "tool", "content": "43"},
           {"role": "assistant", "content": "He has 43 coins. Answer: 43"}]


def trained_runs(ids, mask):
    """The runs of consecutive trained tokens."""
    runs, run = [], []
    for token, trained in zip(ids, mask):
        if trained:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return runs + [run] if run else runs


def test_conversations_through_sentencepiece(tmp_path):
    """BOS, then per turn its role header (never trained) and its content with EOS, trained for
    assistant turns, for others only with "train": true."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(SENTENCEPIECE))
    turns = [dict(m) for m in EPISODE]
    turns[1]["train"] = True
    path = write(tmp_path, {"messages": turns, "reward": 1, "group": 0})
    (trajectory,) = read_rollouts(path, 256, SENTENCEPIECE).trajectories
    want_ids, want_mask = [1], [False]
    for m in turns:
        header, content = sp.encode(f"{m['role']}:"), sp.encode(m["content"]) + [2]
        want_ids += header + content
        want_mask += [False] * len(header) + [m.get("train", m["role"] == "assistant")] * len(content)
    assert trajectory.tokens == want_ids and trajectory.loss_mask == want_mask
    assert trained_runs(trajectory.tokens, trajectory.loss_mask) == [sp.encode(turns[k]["content"]) + [2] for k in (1, 2, 4)]


def test_conversations_through_a_chat_template(tmp_path, hf_folder):
    """The chat template's rendering of all turns; trained: each assistant turn's content and end
    token, not its header (the generation prompt) nor the system, user and tool turns."""
    raw = Tokenizer.from_file(str(hf_folder / "tokenizer.json"))
    end = raw.token_to_id("<|im_end|>")
    path = write(tmp_path, {"messages": EPISODE, "reward": 1, "group": 0})
    (trajectory,) = read_rollouts(path, 256, hf_folder).trajectories
    rendered = "".join(f"<|im_start|>{m['role']} {m['content']}<|im_end|>" for m in EPISODE)
    assert trajectory.tokens == raw.encode(rendered, add_special_tokens=False).ids
    assert trained_runs(trajectory.tokens, trajectory.loss_mask) == [
        raw.encode(m["content"], add_special_tokens=False).ids + [end] for m in EPISODE if m["role"] == "assistant"]
    bare = write(tmp_path, {"messages": EPISODE, "reward": 1, "group": 0}, name="bare.jsonl")
    with pytest.raises(RolloutFileError, match=r"bare.jsonl:1: conversations need a chat template, and the tokenizer"):
        read_rollouts(bare, 256, hf_folder / "tokenizer.json")


def test_the_bundled_agent_episodes():
    """examples/data/agent_episodes.jsonl: 4 groups of 4 multi-turn episodes whose first assistant
    turn (and its tool output) pairs share; tool outputs masked, every episode trains a token."""
    from megatron_dualkv import pack_trajectories, trajectory_groups

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(SENTENCEPIECE))
    trajectories = read_rollouts(SENTENCEPIECE.parent / "agent_episodes.jsonl", 256, SENTENCEPIECE).trajectories
    assert [len(g) for g in trajectory_groups(trajectories)] == [4] * 4
    assert {t.reward for t in trajectories} == {0.0, 1.0}
    tool = sp.encode("tool:")
    for t in trajectories:
        assert any(t.loss_mask[1:]) and 0 not in t.tokens  # no <unk>: the corpus's alphabet
        starts = [i for i in range(len(t.tokens)) if t.tokens[i : i + len(tool)] == tool]
        assert starts and all(not t.loss_mask[i + len(tool)] for i in starts)  # the tool's output is not trained
    batch = pack_trajectories(trajectories)
    assert batch.layout.max_depth >= 2 and batch.rho > 2


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"tokens": [1, 2], "reward": 1, "group": 0}\n{"prompt": [1], "responses": [[2]], "rewards": [1]}',
         r":2: a group line in a file of trajectory lines: a file holds rollout groups or trajectories, not both"),
        ('{"tokens": [1, 2], "group": 0}', r":1: a trajectory needs a 'reward' number"),
        ('{"tokens": [1, 2], "reward": true, "group": 0}', r":1: a trajectory needs a 'reward' number"),
        ('{"tokens": [1, 2], "reward": 1}', r":1: a trajectory needs a 'group', a string or an integer"),
        ('{"tokens": [1, 2], "reward": 1, "group": [0]}', r":1: a trajectory needs a 'group'"),
        ('{"tokens": [1, 2], "loss_mask": [1], "reward": 1, "group": 0}',
         r":1: 'loss_mask' must be a list of 2 values 0 or 1, one per token"),
        ('{"tokens": [1, 2], "loss_mask": [1, 2], "reward": 1, "group": 0}', r":1: 'loss_mask' must be a list of 2"),
        ('{"tokens": [], "reward": 1, "group": 0}', r":1: tokens: expected a non-empty list of token ids"),
        ('{"tokens": [1, 300], "reward": 1, "group": 0}', r":1: tokens: token id 300 is outside the model's"),
        ('{"tokens": "some text", "reward": 1, "group": 0}', r":1: a trajectory's 'tokens' are token ids; text comes as 'messages'"),
        ('{"tokens": [1, 2], "reward": 1, "group": 0, "logprobs": [-1, -1]}',
         r":1: 'logprobs' are read with rollout groups only"),
        ('{"tokens": [1], "messages": [], "reward": 1, "group": 0}', r":1: a trajectory has 'tokens' or 'messages'"),
        ('{"messages": [{"role": "user"}], "reward": 1, "group": 0}',
         r":1: 'messages' must be a non-empty list of objects with 'role' and 'content' strings"),
        ('{"messages": [{"role": "user", "content": "x", "train": 1}], "reward": 1, "group": 0}', r":1: 'messages' must"),
        ('{"messages": [{"role": "user", "content": "hi"}], "loss_mask": [1], "reward": 1, "group": 0}',
         r":1: 'loss_mask' goes with 'tokens'"),
        ('{"messages": [{"role": "user", "content": "hi"}], "reward": 1, "group": 0}',
         r":1: text rollouts need a tokenizer \(--tokenizer\)"),
    ],
)
def test_malformed_trajectories_are_reported_with_their_line(tmp_path, line, message):
    path = tmp_path / "ids.jsonl"
    path.write_text(line)
    with pytest.raises(RolloutFileError, match=message):
        read_rollouts(path, 256, tokenizer_path=None)
