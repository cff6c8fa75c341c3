"""Rollout files: JSONL, one group a line or one trajectory a line, and the tokenizers that turn
text rollouts into token ids.

    {"prompt": ..., "responses": [...], "rewards": [...], "logprobs": [[...], ...]}
    {"tokens": [...], "loss_mask": [...], "reward": r, "group": g}
    {"messages": [{"role": ..., "content": ..., "train": ...}, ...], "reward": r, "group": g}

* ``prompt``: token ids, text, or chat messages ``[{"role": "user", "content": "..."}, ...]``,
  rendered with the tokenizer's chat template (``apply_chat_template(...,
  add_generation_prompt=True)``); ``responses``: token ids, or text with a text or chat prompt;
  ``rewards``: one number per response.
* ``logprobs`` (optional, in every line or in none): per response, the inference engine's
  log-prob of each of its tokens, as many as the response has after tokenization (with the EOS
  that a text response gets).
* Text is tokenized by ``load_tokenizer(path)``: a SentencePiece model file (prompt: BOS + text,
  response: text + EOS, as a finished sample ends); or a Hugging Face tokenizer, a
  ``tokenizer.json`` file or a model folder (transformers' ``AutoTokenizer``; a prompt gets the
  special tokens of the tokenizer's own convention, a response the EOS token, which a bare
  ``tokenizer.json`` does not name: pass the folder for it and for a chat template).

Trajectory lines (multi-turn episodes, tree-search rollouts: ``megatron_dualkv.Trajectory``; a
file holds group lines or trajectory lines, not both), packed with shared prefixes by
``pack_trajectories``:

* ``tokens``: token ids; ``loss_mask`` (optional, default all 1): one 0/1 per token, 1 where the
  token is trained (the first token never is: nothing predicts it).
* ``messages`` instead of both: the turns of a conversation, each ``{"role", "content"}`` and
  optionally ``"train"`` (default: true for ``"assistant"`` turns, false for the others: system,
  user and ``"tool"`` outputs are context, masked from the loss). A Hugging Face tokenizer renders
  them with its chat template, and each turn's tokens are those its message adds to the rendering
  of the turns before it (an assistant turn's header, what ``add_generation_prompt`` renders, is
  not trained: the model did not write it); a SentencePiece model renders each turn as a
  ``role:`` header (not trained) and its content and EOS, each encoded on its own, after a BOS.
* ``reward``: a number; ``group``: a string or an integer, the group whose trajectories' rewards
  give each other's advantages (and within which they share prefixes).

Every error is a ``RolloutFileError`` naming the file and line.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .packing import RolloutGroup
from .trajectories import Trajectory

SENTENCEPIECE_SUFFIX = ".model"
# The files that make a folder a Hugging Face tokenizer (AutoTokenizer reads it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Embedding rows that a published config adds past its tokenizer's tokens (Qwen3: 151,936 rows for
# 151,669 tokens): a tokenizer that leaves more of the vocabulary unused belongs to another model.
VOCAB_PADDING = 1024


class RolloutFileError(ValueError):
    """A rollout file or tokenizer that cannot be read: the message names the file (and line)."""


@dataclass
class Rollouts:
    """A rollout file's groups and, when its lines have them, the inference engine's log-probs
    (per group, per response, an (R,) float32 tensor); or a trajectory file's trajectories, in
    file order (``groups`` is then empty)."""

    groups: List[RolloutGroup]
    logprobs: Optional[List[List[Tensor]]] = None
    trajectories: Optional[List[Trajectory]] = None
    tokenizer: Optional[Path] = None  # the tokenizer of the text lines; None: the file holds token ids only


class SentencePieceTokenizer:
    """A SentencePiece model: prompts get BOS, responses EOS (where the model defines them)."""

    def __init__(self, path: Path):
        import sentencepiece as spm

        self._model = spm.SentencePieceProcessor(model_file=str(path))
        self.size = self._model.get_piece_size()

    def prompt_ids(self, text: str) -> List[int]:
        return _ids_if_defined(self._model.bos_id()) + self._model.encode(text)

    def response_ids(self, text: str) -> List[int]:
        return self._model.encode(text) + _ids_if_defined(self._model.eos_id())

    def chat_prompt_ids(self, messages: List[dict]) -> List[int]:
        raise RolloutFileError("chat prompts need a Hugging Face tokenizer with a chat template; "
                               "this is a SentencePiece model")

    def conversation_ids(self, messages: List[dict]) -> Tuple[List[int], List[bool]]:
        """BOS, then per turn a ``role:`` header and ``content`` EOS, each encoded on its own; the
        content and EOS trained as the turn says, the header not."""
        ids = _ids_if_defined(self._model.bos_id())
        mask = [False] * len(ids)
        for message in messages:
            header = self._model.encode(f"{message['role']}:")
            content = self._model.encode(message["content"]) + _ids_if_defined(self._model.eos_id())
            ids += header + content
            mask += [False] * len(header) + [_trained(message)] * len(content)
        return ids, mask


class HuggingFaceTokenizer:
    """A transformers tokenizer: a prompt gets its special tokens, a response the EOS token."""

    def __init__(self, tokenizer, source: Path):
        self._tokenizer, self._source = tokenizer, source
        self.size = len(tokenizer)

    def prompt_ids(self, text: str) -> List[int]:
        return self._tokenizer(text, add_special_tokens=True).input_ids

    def response_ids(self, text: str) -> List[int]:
        return self._tokenizer(text, add_special_tokens=False).input_ids + _ids_if_defined(self._tokenizer.eos_token_id)

    def chat_prompt_ids(self, messages: List[dict]) -> List[int]:
        self._check_chat_template("chat prompts")
        return self._rendered(messages, add_generation_prompt=True)

    def conversation_ids(self, messages: List[dict]) -> Tuple[List[int], List[bool]]:
        """The chat template's rendering of ``messages``; each turn's tokens (what it adds to the
        rendering of the turns before it) trained as it says, an assistant turn's header not."""
        self._check_chat_template("conversations")
        turns = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids, mask = [], []
        for k, message in enumerate(messages):
            full = self._rendered(turns[: k + 1], add_generation_prompt=False)
            if full[: len(ids)] != ids:
                raise RolloutFileError(f"the chat template renders turn {k} so that the turns before it tokenize "
                                       "differently: its tokens are not an extension of theirs")
            header = 0
            if message["role"] == "assistant":  # the generation prompt's header; tokens may merge at its end
                prompt = self._rendered(turns[:k], add_generation_prompt=True)
                header = len(os.path.commonprefix([prompt, full])) - len(ids)
            added = len(full) - len(ids)
            mask += [False] * max(header, 0) + [_trained(message)] * (added - max(header, 0))
            ids = full
        return ids, mask

    def _check_chat_template(self, what: str) -> None:
        if not self._tokenizer.chat_template:
            raise RolloutFileError(f"{what} need a chat template, and the tokenizer {self._source} has none "
                                   "(pass the model folder whose tokenizer_config.json has one)")

    def _rendered(self, messages: List[dict], add_generation_prompt: bool) -> List[int]:
        # the template writes the special tokens itself
        text = self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
        return self._tokenizer(text, add_special_tokens=False).input_ids


def find_tokenizer(folder) -> Optional[Path]:
    """``folder`` when it holds a Hugging Face tokenizer (a model folder, a converted checkpoint's
    copy of one), else None."""
    folder = Path(folder)
    return folder if any((folder / name).is_file() for name in TOKENIZER_FILES) else None


def load_tokenizer(path, vocab_size: int):
    """The tokenizer at ``path`` (module docstring); RolloutFileError when it is missing, unreadable
    or of another vocabulary than the model's: larger, or smaller by more than the padding of a
    published config (``VOCAB_PADDING``)."""
    path = Path(path)
    if not path.exists():
        raise RolloutFileError(f"tokenizer not found: {path}")
    if path.is_file() and path.suffix == SENTENCEPIECE_SUFFIX:
        tokenizer = SentencePieceTokenizer(path)
    else:
        tokenizer = HuggingFaceTokenizer(_transformers_tokenizer(path), path)
    if not vocab_size - VOCAB_PADDING <= tokenizer.size <= vocab_size:
        raise RolloutFileError(f"tokenizer {path} has {tokenizer.size:,} tokens, the model's vocabulary {vocab_size:,}: "
                               "it is another model's tokenizer; pass the model's own (--tokenizer)")
    return tokenizer


def _transformers_tokenizer(path: Path):
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise RolloutFileError(f"the Hugging Face tokenizer {path} needs transformers: pip install transformers") from None
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a folder or file it cannot read
        raise RolloutFileError(f"tokenizer {path}: not a SentencePiece .model, tokenizer.json or tokenizer folder "
                               f"({type(err).__name__}: {err})") from None


def read_rollouts(path, vocab_size: int, tokenizer_path=None) -> Rollouts:
    """The ``Rollouts`` of the JSONL file at ``path`` (module docstring): its groups, or its
    trajectories; token ids must lie in the model's vocabulary. The tokenizer is loaded at the
    first text line."""
    path = Path(path)
    if not path.is_file():
        raise RolloutFileError(f"rollouts file not found: {path}")
    loaded = []

    def tokenizer(where: str):
        if not loaded:
            if tokenizer_path is None:
                raise RolloutFileError(f"{where}: text rollouts need a tokenizer (--tokenizer)")
            loaded.append(load_tokenizer(tokenizer_path, vocab_size))
        return loaded[0]

    groups, logprobs, with_logprobs, trajectories, kind = [], [], None, [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        record = _json(line, where)
        this = "trajectory" if isinstance(record, dict) and record.keys() & {"tokens", "messages"} else "group"
        if kind is not None and this != kind:
            raise RolloutFileError(f"{where}: a {this} line in a file of {kind} lines: a file holds rollout groups "
                                   "or trajectories, not both")
        kind = this
        if kind == "trajectory":
            trajectories.append(_trajectory(record, tokenizer, vocab_size, where))
            continue
        _check_group(record, where)
        prompt, responses = _token_ids(tokenizer, record["prompt"], record["responses"], where)
        for what, ids in (("prompt", prompt), *((f"response {i}", r) for i, r in enumerate(responses))):
            _check_token_ids(ids, vocab_size, f"{where}: {what}")
        if with_logprobs is None:
            with_logprobs = "logprobs" in record
        if with_logprobs != ("logprobs" in record):
            first, this = ("has", "lacks") if with_logprobs else ("lacks", "has")
            raise RolloutFileError(f"{where}: 'logprobs' must be in every line or in none: "
                                   f"the first line {first} them, this one {this}")
        if with_logprobs:
            logprobs.append(_logprobs(record["logprobs"], responses, where))
        groups.append(RolloutGroup(prompt, responses, [float(r) for r in record["rewards"]]))
    used = Path(tokenizer_path) if loaded else None
    if trajectories:
        return Rollouts([], trajectories=trajectories, tokenizer=used)
    if not groups:
        raise RolloutFileError(f"{path}: no rollout groups")
    return Rollouts(groups, logprobs if with_logprobs else None, tokenizer=used)


def _json(line: str, where: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise RolloutFileError(f"{where}: not valid JSON ({err.msg})") from None


def _check_group(record, where: str) -> None:
    if not isinstance(record, dict) or not {"prompt", "responses", "rewards"} <= record.keys():
        raise RolloutFileError(f"{where}: expected an object with 'prompt', 'responses' and 'rewards' (a rollout "
                               "group), or with 'tokens' or 'messages', 'reward' and 'group' (a trajectory)")
    responses, rewards = record["responses"], record["rewards"]
    if not isinstance(responses, list) or not responses:
        raise RolloutFileError(f"{where}: 'responses' must be a non-empty list")
    if not isinstance(rewards, list) or len(rewards) != len(responses) or not all(_is_number(r) for r in rewards):
        raise RolloutFileError(f"{where}: 'rewards' must be a list of {len(responses)} numbers, one per response")


def _trajectory(record: dict, tokenizer, vocab_size: int, where: str) -> Trajectory:
    """A trajectory line (module docstring) as a ``Trajectory``."""
    if not _is_number(record.get("reward")):
        raise RolloutFileError(f"{where}: a trajectory needs a 'reward' number")
    group = record.get("group")
    if isinstance(group, bool) or not isinstance(group, (str, int)):
        raise RolloutFileError(f"{where}: a trajectory needs a 'group', a string or an integer: the trajectories whose "
                               "rewards give each other's advantages")
    if "logprobs" in record:
        raise RolloutFileError(f"{where}: 'logprobs' are read with rollout groups only, not with trajectories")
    if {"tokens", "messages"} <= record.keys():
        raise RolloutFileError(f"{where}: a trajectory has 'tokens' or 'messages', not both")
    if "messages" in record:
        if "loss_mask" in record:
            raise RolloutFileError(f"{where}: 'loss_mask' goes with 'tokens'; 'messages' mark trained turns "
                                   "with 'train'")
        ids, loss_mask = _conversation_ids(tokenizer, record["messages"], where)
    else:
        ids, loss_mask = record["tokens"], record.get("loss_mask")
        if isinstance(ids, str):
            raise RolloutFileError(f"{where}: a trajectory's 'tokens' are token ids; text comes as 'messages', "
                                   "whose turns say what is trained")
        if isinstance(ids, list) and loss_mask is not None and not _is_loss_mask(loss_mask, len(ids)):
            raise RolloutFileError(f"{where}: 'loss_mask' must be a list of {len(ids)} values 0 or 1, one per token")
    _check_token_ids(ids, vocab_size, f"{where}: tokens")
    return Trajectory(ids, loss_mask, float(record["reward"]), group)


def _conversation_ids(tokenizer, messages, where: str) -> Tuple[List[int], List[bool]]:
    well_formed = _is_chat(messages) and all(isinstance(m.get("train", False), bool) for m in messages)
    if not well_formed:
        raise RolloutFileError(f"{where}: 'messages' must be a non-empty list of objects with 'role' and 'content' "
                               "strings and an optional 'train' true or false")
    try:
        return tokenizer(where).conversation_ids(messages)
    except RolloutFileError as err:
        raise RolloutFileError(f"{where}: {err}") from None


def _trained(message: dict) -> bool:
    """Whether a conversation turn is trained: its ``train`` flag, by default assistant turns only."""
    return message.get("train", message["role"] == "assistant")


def _is_loss_mask(values, length: int) -> bool:
    return isinstance(values, list) and len(values) == length and all(
        isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)) for v in values)


def _token_ids(tokenizer, prompt, responses: list, where: str):
    """(prompt ids, response ids): token-id lists as they are, text and chat through ``tokenizer(where)``."""
    if isinstance(prompt, str) or _is_chat(prompt):
        if not all(isinstance(r, str) for r in responses):
            raise RolloutFileError(f"{where}: a text or chat prompt needs text responses")
        text = tokenizer(where)
        try:
            prompt_ids = text.prompt_ids(prompt) if isinstance(prompt, str) else text.chat_prompt_ids(prompt)
        except RolloutFileError as err:
            raise RolloutFileError(f"{where}: {err}") from None
        return prompt_ids, [text.response_ids(r) for r in responses]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        raise RolloutFileError(f"{where}: chat messages must be objects with 'role' and 'content' strings")
    return prompt, responses


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    )


def _logprobs(values, responses: Sequence[Sequence[int]], where: str) -> List[Tensor]:
    if not isinstance(values, list) or len(values) != len(responses):
        raise RolloutFileError(f"{where}: 'logprobs' must be a list of {len(responses)} lists, one per response")
    out = []
    for i, (lp, ids) in enumerate(zip(values, responses)):
        if not isinstance(lp, list) or len(lp) != len(ids):
            count = f"{len(lp)} values" if isinstance(lp, list) else type(lp).__name__
            raise RolloutFileError(f"{where}: 'logprobs' of response {i} has {count}, the response has {len(ids)} tokens")
        if not all(_is_number(x) and math.isfinite(x) and x <= 0 for x in lp):
            raise RolloutFileError(f"{where}: 'logprobs' of response {i} must be finite numbers <= 0 (log-probabilities)")
        out.append(torch.tensor(lp, dtype=torch.float32))
    return out


def _ids_if_defined(token_id: Optional[int]) -> List[int]:
    return [] if token_id is None or token_id < 0 else [token_id]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_token_ids(ids, vocab_size: int, where: str) -> None:
    if not isinstance(ids, list) or not ids:
        raise RolloutFileError(f"{where}: expected a non-empty list of token ids (or text)")
    for x in ids:
        if isinstance(x, bool) or not isinstance(x, int):
            raise RolloutFileError(f"{where}: token ids must be integers, got {x!r}")
        if not 0 <= x < vocab_size:
            raise RolloutFileError(f"{where}: token id {x} is outside the model's vocabulary (vocab_size {vocab_size})")
