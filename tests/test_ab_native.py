"""tools/ab_native.py: the variant list it accepts (the GPU part runs on the lent H200 only)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from ab_native import parse_variants  # noqa: E402

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def test_parses_named_source_folders():
    assert parse_variants(f"main={CSRC},same={CSRC}") == {"main": CSRC, "same": CSRC}


@pytest.mark.parametrize("spec, message", [
    ("main", "not name=folder"),
    (f"=x,{CSRC}", "not name=folder"),
    (f"a={CSRC},a={CSRC}", "given twice"),
    ("a=/nowhere", "no dualkv_sm90.cpp"),
])
def test_bad_variants_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(spec)
