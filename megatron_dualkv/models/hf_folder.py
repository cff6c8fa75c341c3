"""Hugging Face checkpoint folders: ``config.json`` plus safetensors weights, either one
``model.safetensors`` or shards listed by ``model.safetensors.index.json`` (as published and as
``save_pretrained`` writes them).

``HFWeights`` reads one tensor at a time (safetensors files are memory-mapped, so only the tensor
asked for is read); ``SafetensorsShardWriter`` writes shard by shard. ``hf_card`` turns the folder's
``config.json`` into the model card of the model to convert, and refuses what no family supports.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .builder import FAMILIES
from .cards import ModelCard, load_card

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Weight files of any framework: never copied along with the tokenizer and other small files.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".distcp", ".index.json")
# Multimodal checkpoints (``*ForConditionalGeneration``) name their text decoder's tensors under a
# prefix: ``model.language_model.`` (transformers 5) or ``language_model.model.`` (transformers 4).
_LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",
}
# Fields a multimodal config keeps at its top level that its text decoder needs, where its
# text_config leaves them out.
_INHERITED_BY_TEXT_CONFIG = ("dtype", "torch_dtype")
# Fields of the multimodal model itself, which win over its text_config's: transformers ties the
# composite model's lm_head by the top-level flag (Qwen3.5's text_config says False beside a top-level True).
_OWNED_BY_TOP_CONFIG = ("tie_word_embeddings",)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def hf_card(folder: Path, text_only: bool = False) -> Tuple[ModelCard, Optional[Callable[[str], Optional[str]]]]:
    """The card of the model in ``folder`` and, for the text decoder of a multimodal checkpoint
    (``text_only=True``: Gemma 3, Qwen3.5), how its tensor names become the text model's (None: leave
    the tensor out, as a vision tower and Qwen3.5's multi-token-prediction layer ``mtp.*``).

    ValueError for a ``model_type`` no family supports, and for a multimodal checkpoint without
    ``text_only``.
    """
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{folder} has no {CONFIG_NAME}: not a Hugging Face checkpoint folder")
    config = _read_json(path)
    model_type, architectures = config.get("model_type"), config.get("architectures")
    if model_type in FAMILIES:
        return load_card(path), None
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("model_type") in FAMILIES:
        if not text_only:
            raise ValueError(
                f"{path} describes the multimodal model {model_type!r} ({architectures}); this library trains its text "
                f"decoder ({text['model_type']!r}): convert that with text_only=True (--text-only), which leaves the "
                "vision tower out"
            )
        inherited = {key: config[key] for key in _INHERITED_BY_TEXT_CONFIG if key in config}
        owned = {key: config[key] for key in _OWNED_BY_TOP_CONFIG if key in config}
        return ModelCard(folder.name, {**inherited, **text, **owned}), _language_model_name
    raise ValueError(
        f"{path}: unsupported model_type {model_type!r} (architectures {architectures}); supported: {sorted(FAMILIES)}"
    )


def left_out_parts(names: Iterable[str]) -> List[str]:
    """The modules that tensors ``names`` belong to: ``model.visual`` under ``model.``, else the first
    component (``mtp``, transformers 4's ``vision_tower``)."""
    return sorted({".".join(name.split(".")[:2 if name.startswith("model.") else 1]) for name in names})


def _language_model_name(name: str) -> Optional[str]:
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None


class HFWeights:
    """The safetensors tensors of a Hugging Face folder, under the names of the model converted.

    rename: stored name -> model name, or None to leave the tensor out (``left_out`` lists those).
    """

    def __init__(self, folder: Path, rename: Optional[Callable[[str], Optional[str]]] = None):
        self._source: Dict[str, Tuple[Path, str]] = {}
        self.left_out: List[str] = []
        for stored, file in _weight_files(folder).items():
            name = stored if rename is None else rename(stored)
            if name is None:
                self.left_out.append(stored)
            else:
                self._source[name] = (file, stored)
        self._handles: Dict[Path, Tuple[object, set]] = {}  # file -> (open file, the names it holds)

    @property
    def names(self) -> List[str]:
        return list(self._source)

    def meta(self, name: str) -> Tensor:
        """A meta tensor of the stored shape and dtype (read from the file header only)."""
        file, stored = self._source[name]
        view = self._handle(file, stored).get_slice(stored)
        dtype = _DTYPES.get(view.get_dtype())
        if dtype is None:
            raise ValueError(f"{file}: tensor {stored} has the unsupported dtype {view.get_dtype()}")
        return torch.empty(view.get_shape(), dtype=dtype, device="meta")

    def tensor(self, name: str) -> Tensor:
        file, stored = self._source[name]
        return self._handle(file, stored).get_tensor(stored)

    def _handle(self, file: Path, stored: str):
        if file not in self._handles:
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle, set(handle.keys())
        handle, names = self._handles[file]
        if stored not in names:
            raise ValueError(f"{INDEX_NAME} places {stored} in {file.name}, which does not hold it")
        return handle


def _weight_files(folder: Path) -> Dict[str, Path]:
    """Stored tensor name -> its safetensors file."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(file.name) for file in files.values() if not file.is_file()})
        if absent:
            raise ValueError(f"{index} lists shards that are not in {folder}: {absent}")
        return files
    single = folder / WEIGHTS_NAME
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise ValueError(f"{folder} has neither {WEIGHTS_NAME} nor {INDEX_NAME} (only safetensors weights are read)")


class SafetensorsShardWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` each (a larger tensor
    gets a shard of its own), named as ``save_pretrained`` names them: ``model.safetensors`` when
    one shard holds everything, else ``model-0000i-of-0000n.safetensors`` and the index."""

    def __init__(self, folder: Path, max_shard_bytes: int):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self._folder, self._max_bytes = folder, max_shard_bytes
        self._pending: Dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._shards: List[Tuple[Path, List[str]]] = []
        self._written: set = set()
        self._total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self._written:
            raise ValueError(f"tensor {name} written twice")
        self._written.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self._max_bytes:
            self._flush()
        # a copy of its own: safetensors refuses tensors that share memory (views of one fused tensor)
        self._pending[name] = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def finish(self) -> None:
        """Write the last shard, give the shards their final names and write the index."""
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            self._shards[0][0].rename(self._folder / WEIGHTS_NAME)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{len(self._shards):05d}.safetensors"
            path.rename(self._folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self._folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")

    def _flush(self) -> None:
        path = self._folder / f"shard-{len(self._shards) + 1:05d}.partial"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0


def copy_small_files(source: Path, target: Path, skip: Iterable[str] = ()) -> None:
    """Copy the regular files of ``source`` that are not weights (config, tokenizer, generation
    config, chat template) and not in ``skip`` into ``target``."""
    skip = set(skip)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in skip and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, target / path.name)


def write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def parse_size(size) -> int:
    """Bytes from an int or a string like ``"5GB"`` / ``"500MB"`` / ``"100KB"`` (powers of 1000,
    as ``save_pretrained``'s ``max_shard_size``)."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            number = text[: -len(unit)].strip()
            try:
                return int(float(number) * factor)
            except ValueError:
                break
    raise ValueError(f"size {size!r} is not an int or a string like '5GB', '500MB'")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None

