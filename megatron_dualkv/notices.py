"""Megatron-Core's notices that say nothing about a run of this library, hidden by the launch script
and the tools unless they are given ``--verbose``.

Megatron-Core warns, when it is imported and while it builds a model, that Transformer Engine and
Apex are not installed (both are optional here: docs/embedding.md says what runs in their place),
that its ``GPTModel`` is deprecated (0.19), that ``MimoModelConfig`` is experimental, and (0.16) that
a layer spec's MLP is of a type it does not know (our MLP subclasses, which take its defaults); torch
warns that collectives and checkpoint functions that Megatron-Core calls are deprecated; and on a
CPU, Megatron-Core's advice for sequence parallelism on a GPU. Any other warning still shows.
Call ``hide_expected_notices()`` before Megatron-Core is imported: most of these are raised at
import.
"""
from __future__ import annotations

import logging
import sys
import warnings

import torch

EXPECTED_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"MimoModelConfig is experimental",
    # torch's deprecations of what Megatron-Core calls: its collectives and its checkpoint reader
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    r"`load_state_dict` is deprecated and will be removed in future versions",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)
# Megatron-Core's advice for sequence parallelism on a GPU, which a CPU run cannot follow
CPU_WARNINGS = (r"When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX",)
# (logger, start of the message) of what Megatron logs at WARNING level
EXPECTED_LOG_RECORDS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.transformer.transformer_layer", "Unknown MLP type"),
)


def hide_expected_notices(argv=None) -> None:
    """Hide the notices above, unless ``--verbose`` is among ``argv`` (default: the command line)."""
    if "--verbose" in (sys.argv if argv is None else argv):
        return
    for pattern in EXPECTED_WARNINGS + (() if torch.cuda.is_available() else CPU_WARNINGS):
        warnings.filterwarnings("ignore", message=pattern)
    for name, start in EXPECTED_LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropMessages(start))


class _DropMessages(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)
