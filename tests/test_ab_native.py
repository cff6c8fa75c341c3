"""tools/ab_native.py: the variant list it accepts (the GPU part runs on the lent H200 only)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from ab_native import ROOT, Variant, parse_variants  # noqa: E402

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def test_parses_named_source_folders():
    ours = Variant(CSRC, ROOT)
    assert parse_variants(f"main={CSRC},same={CSRC}") == {"main": ours, "same": ours}


def test_a_whole_checkout_runs_with_its_own_python(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "dualkv_sm90.cpp").write_text("")
    (tmp_path / "megatron_dualkv").mkdir()
    assert parse_variants(f"main={ROOT},new={tmp_path}") == {
        "main": Variant(CSRC, ROOT), "new": Variant(tmp_path.resolve() / "csrc", tmp_path.resolve())}


@pytest.mark.parametrize("spec, message", [
    ("main", "not name=folder"),
    (f"=x,{CSRC}", "not name=folder"),
    (f"a={CSRC},a={CSRC}", "given twice"),
    ("a=/nowhere", "no dualkv_sm90.cpp"),
])
def test_bad_variants_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(spec)
