"""megatron_dualkv.notices: Megatron-Core's expected notices hidden, every other warning kept."""
import logging
import warnings

import pytest

from megatron_dualkv.notices import EXPECTED_LOG_RECORDS, hide_expected_notices


@pytest.fixture
def restored_loggers():
    loggers = [logging.getLogger(name) for name, _ in EXPECTED_LOG_RECORDS]
    before = [list(logger.filters) for logger in loggers]
    yield
    for logger, filters in zip(loggers, before):
        logger.filters[:] = filters


def test_only_the_expected_notices_are_hidden(restored_loggers, caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_expected_notices([])
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("a warning of the run itself")
    assert [str(w.message) for w in caught] == ["a warning of the run itself"]
    with caplog.at_level(logging.WARNING):
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is ...")
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]


def test_verbose_keeps_them(restored_loggers):
    filters = [list(logging.getLogger(name).filters) for name, _ in EXPECTED_LOG_RECORDS]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_expected_notices(["script.py", "--verbose"])
        warnings.warn("Transformer Engine and Apex are not installed.")
    assert len(caught) == 1
    assert [logging.getLogger(name).filters for name, _ in EXPECTED_LOG_RECORDS] == filters
