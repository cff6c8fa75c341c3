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
