"""How the launch script and the tools report a bad flag or input: one line on stderr, from rank 0
only, without a traceback.

Under torchrun every process parses the same command line and reads the same files, so each one
finds the same problem; one copy of the message is enough (``RANK`` is torchrun's; a plain
process is rank 0). Every process still exits with status 2, so that torchrun stops them all (and
prints its own summary of the failed processes after the message).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn, Optional, Tuple

USAGE_ERROR = 2  # argparse's exit status for a usage error
RANK0_GRACE_S = 1.0


def exit_with_error(message: str) -> NoReturn:
    """Print ``error: <message>`` on rank 0 and exit every rank with status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:  # torchrun stops every process once one fails: rank 0 gets the time to print first
        time.sleep(RANK0_GRACE_S)
    raise SystemExit(USAGE_ERROR)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a bad choice, a missing value, ``parser.error``) are
    one line from rank 0 (``exit_with_error``) instead of the usage block on every rank."""

    def error(self, message: str) -> NoReturn:
        exit_with_error(message)


# --transformer-engine -> build_model's use_transformer_engine
TRANSFORMER_ENGINE = {"auto": None, "on": True, "off": False}
# --fp8's formats: builder.FP8_FORMATS, written out here because the flags are parsed before
# Megatron-Core is imported (tests/test_transformer_engine.py checks that they agree)
FP8_CHOICES = ("e4m3", "hybrid")


def add_layer_spec_flags(parser) -> None:
    """``--transformer-engine {auto,on,off}`` and ``--fp8 {off,e4m3,hybrid}``, as the launch script
    and the tools that build models take them (``spec_kwargs``)."""
    parser.add_argument("--transformer-engine", choices=sorted(TRANSFORMER_ENGINE), default="auto",
                        help="the layer spec: Transformer Engine's (on) or the torch-native local one (off); auto: "
                             "TE's when transformer_engine imports and there is a GPU")
    parser.add_argument("--fp8", choices=("off", *FP8_CHOICES), default="off",
                        help="Transformer Engine's linears in FP8 (e4m3, or hybrid: e5m2 gradients), current "
                             "scaling; attention stays in bf16. Needs the TE spec, a GPU with FP8 (Ada, Hopper) "
                             "and bf16 parameters")


def spec_kwargs(args: argparse.Namespace) -> dict:
    """``build_model``'s ``use_transformer_engine`` and ``fp8`` of the flags ``add_layer_spec_flags`` adds."""
    fp8: Optional[str] = None if args.fp8 == "off" else args.fp8
    return {"use_transformer_engine": TRANSFORMER_ENGINE[args.transformer_engine], "fp8": fp8}


def layer_spec(args: argparse.Namespace, card=None) -> Tuple[bool, Optional[str]]:
    """(whether the run builds the Transformer Engine spec, its FP8 format or None), from the flags of
    ``add_layer_spec_flags``, resolved as ``build_model`` resolves them for ``card`` (a family without
    a TE spec builds the local one): ImportError or ValueError where --transformer-engine on cannot
    run here."""
    from .models.builder import family_of, uses_transformer_engine  # Megatron-Core: once the flags are checked
    from .models.cards import load_card

    kwargs = spec_kwargs(args)
    family = None if card is None else family_of(load_card(card))
    return uses_transformer_engine(kwargs["use_transformer_engine"], family), kwargs["fp8"]


def spec_label(transformer_engine: bool, fp8: Optional[str]) -> str:
    """The layer spec as the launch script's first line and the benchmarks' tables name it."""
    return "transformer-engine" + (f" fp8 {fp8}" if fp8 else "") if transformer_engine else "local"


def memory_margin_problem(margin: Optional[float]) -> Optional[str]:
    """What is wrong with a --memory-margin (the launch script's and the bench's), None when nothing."""
    return None if margin is None or 0 <= margin < 1 else f"--memory-margin must be in [0, 1), got {margin}"
