"""Command-line helpers shared by the tools."""
from __future__ import annotations

import argparse
from typing import Iterable, List


def comma_names(parser: argparse.ArgumentParser, option: str, text: str, known: Iterable[str]) -> List[str]:
    """``text``'s comma-separated names, each one of ``known``; else a usage error naming ``option``."""
    names, known = text.split(","), list(known)
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """``--verbose``: the tool hides Megatron-Core's notices that Transformer Engine and Apex are not
    installed and its deprecations (``megatron_dualkv.notices``, called before Megatron-Core is
    imported) unless it is given."""
    parser.add_argument("--verbose", action="store_true",
                        help="also show Megatron-Core's notices about Transformer Engine, Apex and deprecations")
