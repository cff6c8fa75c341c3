"""tools/tool_args.py: the comma lists of names the tools take."""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from tool_args import comma_names  # noqa: E402


def test_known_names_in_the_given_order():
    assert comma_names(argparse.ArgumentParser(), "--x", "c,a", ["a", "b", "c"]) == ["c", "a"]


def test_an_unknown_name_is_a_usage_error_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        comma_names(argparse.ArgumentParser(), "--tune", "dq,nope", ["fwd", "dq"])
    assert "--tune: unknown nope; choose from fwd, dq" in capsys.readouterr().err
