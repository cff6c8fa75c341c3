"""How far FP8 moves the per-token log-probs from bf16, on the same weights.

An RL user switching Transformer Engine's FP8 on needs to know how much it changes the policy's
log-probs, which enter every importance ratio. This builds the model once in bf16 on the TE spec,
then in each FP8 format with the same weights, runs the rollouts forward (packed layout, no
gradient) and compares the trained tokens' log-probs: mean, 99th percentile and largest absolute
difference, in nats. The local spec in bf16 on the same weights is the yardstick: what two bf16
implementations of the same model differ by. Weights: a converted Megatron checkpoint folder
(``--model DIR``: what you train) or a card's random initialisation.

Prints a table and writes CSV (needs a GPU with FP8 and Transformer Engine):

    python tools/fp8_logprob_error.py --model qwen3-4b --rollouts group.jsonl --out bench/
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TOOLS), TOOLS]
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from tool_args import add_verbose_flag, comma_names  # noqa: E402
from megatron_dualkv import pack_groups  # noqa: E402
from megatron_dualkv.cli import ArgumentParser, exit_with_error  # noqa: E402
from megatron_dualkv.mcore import transformer_engine_available  # noqa: E402
from megatron_dualkv.models import build_model, checkpoint_card, load_card, load_model  # noqa: E402
from megatron_dualkv.models.builder import FP8_FORMATS  # noqa: E402
from megatron_dualkv.models.family import load_megatron_state_dict, local_spec_state_dict  # noqa: E402
from megatron_dualkv.rl import forward_logprobs  # noqa: E402
from megatron_dualkv.rollout_io import RolloutFileError, read_rollouts  # noqa: E402

COLUMNS = ["model", "against_te_bf16", "tokens", "mean_abs", "p99_abs", "max_abs", "mean_signed"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-4b", help="a card (random weights) or a converted checkpoint folder")
    parser.add_argument("--rollouts", type=Path, required=True, help="a rollout file (the launch script's --rollouts)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="for text rollouts (the launch script's --tokenizer)")
    parser.add_argument("--groups", type=int, default=1, help="rollout groups to compare, from the file's start")
    parser.add_argument("--fp8", default=",".join(FP8_FORMATS), help="comma list of FP8 formats")
    parser.add_argument("--out", type=Path, default=None, help="folder for fp8_logprob_error.csv")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    args.fp8 = comma_names(parser, "--fp8", args.fp8, FP8_FORMATS)
    return args


def _trained_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([lp for group in forward_logprobs(model, batch) for lp in group])


def _bf16_model(name: str):
    kwargs = dict(dtype=torch.bfloat16, use_transformer_engine=True)
    return load_model(name, **kwargs) if Path(name).is_dir() else build_model(name, **kwargs)


def _row(model: str, variant: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = got - want
    error = diff.abs()
    return dict(model=model, against_te_bf16=variant, tokens=error.numel(), mean_abs=error.mean().item(),
                p99_abs=error.quantile(0.99).item() if error.numel() <= 2**24 else float("nan"),
                max_abs=error.max().item(), mean_signed=diff.mean().item())


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (torch.cuda.is_available() and transformer_engine_available()):
        exit_with_error("FP8 runs in Transformer Engine's linears: this needs CUDA and transformer_engine")
    card = checkpoint_card(args.model) if Path(args.model).is_dir() else load_card(args.model)
    try:
        rollouts = read_rollouts(args.rollouts, card.config["vocab_size"], args.tokenizer)
    except RolloutFileError as error:
        exit_with_error(str(error))
    if not rollouts.groups:
        exit_with_error(f"--rollouts {args.rollouts}: no rollout groups (a trajectory file is not compared)")
    batch = pack_groups(rollouts.groups[: args.groups], pad_to_multiple_of=16)  # FP8 matmuls' row multiple
    reference = _bf16_model(args.model)
    want = _trained_logprobs(reference, batch)
    weights = local_spec_state_dict(reference)
    variants = {"local spec bf16": dict(use_transformer_engine=False)}
    variants.update({f"fp8 {fp8}": dict(use_transformer_engine=True, fp8=fp8) for fp8 in args.fp8})
    rows = []
    for name, spec in variants.items():
        model = build_model(card, dtype=torch.bfloat16, **spec)
        load_megatron_state_dict(model, weights)
        rows.append(_row(card.name, name, _trained_logprobs(model, batch), want))
        del model
    print(f"| model | against TE bf16 | tokens | mean abs | p99 abs | max abs | mean signed |\n|{' --- |' * 7}")
    for r in rows:
        print(f"| {r['model']} | {r['against_te_bf16']} | {r['tokens']:,} | {r['mean_abs']:.4f} | {r['p99_abs']:.4f} | "
              f"{r['max_abs']:.4f} | {r['mean_signed']:+.4f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "fp8_logprob_error.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
