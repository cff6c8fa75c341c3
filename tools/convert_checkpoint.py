"""Convert checkpoints between Hugging Face safetensors folders and Megatron dist-checkpoint folders.

    python tools/convert_checkpoint.py hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N] [--text-only] [--card NAME]
    python tools/convert_checkpoint.py megatron-to-hf --megatron DIR --out DIR [--max-shard-size 5GB]

hf-to-megatron reads config.json and the safetensors shards (model.safetensors, or the shards of
model.safetensors.index.json) of a Qwen3, Qwen3-MoE, Gemma 3, Gemma 4, Qwen3.5 or Qwen3-Next text
model; --tp/--pp/--ep are checked against the model and recorded, and the checkpoint loads at any
sizes (megatron_dualkv.models.load_model): a layer count --pp does not divide is split unevenly,
and the vocabulary is stored as the Hugging Face folder has it, padded only where a model loads it.
--text-only converts the text decoder of a multimodal checkpoint (Gemma 3, Qwen3.5: the vision
tower and Qwen3.5's mtp.* are left out); --card builds from a model card instead of the folder's
config.json (the published Gemma 3 configs leave out fields that take transformers' defaults:
--text-only --card gemma3-27b).

megatron-to-hf writes safetensors shards named as the published checkpoints name their tensors,
the index, config.json and the small files (tokenizer, generation config) that came along.

Both run in one process, stream tensor by tensor (see megatron_dualkv/models/checkpoint.py for
the memory bound), refuse what they cannot convert before writing anything, and write into a
temporary folder next to --out that is renamed to --out only once complete.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from megatron_dualkv.cli import ArgumentParser, exit_with_error  # noqa: E402
from tool_args import add_verbose_flag  # noqa: E402


def main(argv: Optional[List[str]] = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_verbose_flag(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="Hugging Face folder -> Megatron checkpoint folder")
    to_megatron.add_argument("--hf", required=True, help="Hugging Face checkpoint folder (config.json + safetensors)")
    to_megatron.add_argument("--out", required=True, help="Megatron checkpoint folder to create (must not exist)")
    for size in ("tp", "pp", "ep"):
        to_megatron.add_argument(f"--{size}", type=int, default=1, help=f"{size} size the checkpoint is meant for (default 1)")
    to_megatron.add_argument("--text-only", action="store_true", help="convert the text decoder of a multimodal checkpoint")
    to_megatron.add_argument(
        "--card", help="model card (name in models/ or file) to use instead of the folder's config.json, e.g. gemma3-27b "
        "(published multimodal configs leave transformers' defaults out)"
    )
    to_hf = commands.add_parser("megatron-to-hf", help="Megatron checkpoint folder -> Hugging Face folder")
    to_hf.add_argument("--megatron", required=True, help="Megatron checkpoint folder (hf-to-megatron's or save_model's)")
    to_hf.add_argument("--out", required=True, help="Hugging Face folder to create (must not exist)")
    to_hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB (default 5GB)")
    args = parser.parse_args(argv)
    from megatron_dualkv.models import hf_to_megatron, megatron_to_hf  # after the flags: Megatron-Core takes seconds

    try:
        if args.command == "hf-to-megatron":
            hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, text_only=args.text_only, card=args.card)
        else:
            megatron_to_hf(args.megatron, args.out, max_shard_size=args.max_shard_size)
    except ValueError as err:
        exit_with_error(f"{args.command}: {err}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
