"""Folders of the source tree that ship as data packages (``models/`` as ``megatron_dualkv.cards``,
``csrc/`` as ``megatron_dualkv.csrc``; setup.py maps them)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List


def resource_dir(package: str, checkout_folder: str) -> Path:
    """The installed data package, or the folder of a source checkout that was not installed."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[1] / checkout_folder


def cards_dir() -> Path:
    """The installed ``megatron_dualkv.cards`` package, or ``models/`` of a source checkout that was not installed."""
    return resource_dir("megatron_dualkv.cards", "models")


def available_cards() -> List[str]:
    """The names of the bundled model cards (here, without importing the models and Megatron-Core)."""
    return sorted(path.stem for path in cards_dir().glob("*.json"))
