"""Megatron-Core's notices that say nothing about a run of this library, hidden by the launch script
and the tools unless they are given ``--verbose``.

Megatron-Core warns, when it is imported and while it builds a model, that Transformer Engine and
Apex are not installed (both are optional here: docs/embedding.md says what runs in their place),
that its ``GPTModel`` is deprecated (0.19), that ``MimoModelConfig`` is experimental, and (0.16) that
a layer spec's MLP is of a type it does not know (our MLP subclasses, which take its defaults). Any
other warning still shows. Call ``hide_expected_notices()`` before Megatron-Core is imported: most of
these are raised at import.
"""
from __future__ import annotations

import logging
import sys
import warnings

EXPECTED_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"MimoModelConfig is experimental",
)
# (logger, start of the message) of what Megatron logs at WARNING level
EXPECTED_LOG_RECORDS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("megatron.core.transformer.transformer_layer", "Unknown MLP type"),
)


def hide_expected_notices(argv=None) -> None:
    """Hide the notices above, unless ``--verbose`` is among ``argv`` (default: the command line)."""
    if "--verbose" in (sys.argv if argv is None else argv):
        return
    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, start in EXPECTED_LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropMessages(start))


class _DropMessages(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)
