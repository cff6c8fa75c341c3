"""Reading and rewriting one entry of a Megatron-Core layer spec, in either version's spelling:
0.16 writes an entry as a ``ModuleSpec``, 0.17+ as ``functools.partial(module, submodules=...)``."""
from __future__ import annotations

import functools
from dataclasses import replace

from megatron.core.transformer.spec_utils import ModuleSpec


def module_of(spec):
    """The module class an entry builds (None for an entry that is neither spelling)."""
    return spec.module if isinstance(spec, ModuleSpec) else getattr(spec, "func", None)


def submodules_of(spec):
    """The submodules an entry hands its module (None where it hands none)."""
    return spec.submodules if isinstance(spec, ModuleSpec) else getattr(spec, "keywords", {}).get("submodules")


def with_module(spec, module):
    """The entry building ``module`` instead, with the same submodules and arguments."""
    if isinstance(spec, ModuleSpec):
        return replace(spec, module=module)
    return functools.partial(module, *spec.args, **spec.keywords)


def with_submodules(spec, submodules):
    """The entry with ``submodules`` instead."""
    if isinstance(spec, ModuleSpec):
        return replace(spec, submodules=submodules)
    return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
