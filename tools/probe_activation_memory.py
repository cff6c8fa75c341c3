"""What one decoder layer keeps for its backward, measured against the memory model's count.

    python tools/probe_activation_memory.py --cards qwen3-4b,gemma3-4b --tokens 8192   # on the GPU
    python tools/probe_activation_memory.py --cards qwen3-tiny --tokens 256            # CPU dry run
    python tools/probe_activation_memory.py --transformer-engine on --fp8 e4m3         # the TE spec, FP8 linears

For each card and recompute mode: models of one and of two layers (the card's first layers) run the
forward of a packed micro-batch with autograd on; the memory allocated after the forward, minus before,
grows by one layer's saved tensors from one model to the other. Per token, that is what
``megatron_dualkv.memory.layer_activation_bytes`` predicts. Prints a table and writes CSV.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TOOLS, os.path.dirname(TOOLS)]
from megatron_dualkv.notices import hide_expected_notices  # noqa: E402

hide_expected_notices()  # before Megatron-Core is imported, which warns at import (--verbose keeps them)
from bench_attention import write_table  # noqa: E402
from tool_args import add_verbose_flag  # noqa: E402
from megatron_dualkv import RolloutGroup, pack_groups  # noqa: E402
from megatron_dualkv.memory import layer_activation_bytes  # noqa: E402
from megatron_dualkv.mcore.parallel import current_parallel_sizes  # noqa: E402
from megatron_dualkv.cli import add_layer_spec_flags, layer_spec, spec_label  # noqa: E402
from megatron_dualkv.models import build_model  # noqa: E402
from megatron_dualkv.rl.logprobs import model_output  # noqa: E402

MODES = ("none", "selective", "full")


def held_after_forward(card: str, layers: int, mode: str, tokens: int, dtype, transformer_engine: bool = False,
                       fp8=None) -> tuple:
    """(bytes allocated after a forward minus before, the model's config); the layer spec as
    ``build_model``'s ``use_transformer_engine`` and ``fp8`` (tokens: a multiple of 16 for FP8)."""
    model = build_model(card, num_layers=layers, recompute=mode, dtype=dtype, use_transformer_engine=transformer_engine,
                        fp8=fp8)
    vocab = model.unpadded_vocab_size
    prompt = tokens // 2
    group = RolloutGroup(list(torch.randint(3, vocab, (prompt,)).tolist()),
                         [torch.randint(3, vocab, (tokens - prompt,)).tolist()], [1.0])
    batch = pack_groups([group])
    before = allocated()
    output = model_output(model, batch, "packed")
    held = allocated() - before - output.numel() * output.element_size()
    config = model.config
    del output, model
    gc.collect()
    return held, config


def allocated() -> int:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    import psutil

    return psutil.Process().memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cards", default="qwen3-4b,gemma3-4b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tokens", type=int, default=8192)
    add_layer_spec_flags(parser)
    parser.add_argument("--out", default=".")
    add_verbose_flag(parser)
    args = parser.parse_args()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    te, fp8 = layer_spec(args)
    rows = []
    for card in args.cards.split(","):
        for mode in args.modes.split(","):
            one, _ = held_after_forward(card, 1, mode, args.tokens, dtype, te, fp8)
            two, config = held_after_forward(card, 2, mode, args.tokens, dtype, te, fp8)
            measured = (two - one) / args.tokens
            predicted = layer_activation_bytes(config, 2, current_parallel_sizes(config), mode, "packed", te,
                                               fp8 is not None)
            rows.append(dict(card=card, mode=mode, measured=measured, predicted=predicted,
                             # a CPU dry run's RSS can miss a small layer: no deviation then
                             deviation=100 * (predicted - measured) / measured if measured > 0 else float("nan")))
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, {args.tokens} tokens, {dtype}, "
          f"spec {spec_label(te, fp8)}")
    os.makedirs(args.out, exist_ok=True)
    write_table(rows, os.path.join(args.out, "activation_memory.csv"), [
        ("card", "card", "12"), ("mode", "mode", "10"), ("measured", "B/token/layer", "13.0f"),
        ("predicted", "predicted", "10.0f"), ("deviation", "model - measured %", "19.1f"),
    ])


if __name__ == "__main__":
    main()
