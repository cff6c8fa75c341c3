"""How the launch script and the tools report a bad flag or input: one line on stderr, from rank 0
only, without a traceback.

Under torchrun every process parses the same command line and reads the same files, so each one
finds the same problem; one copy of the message is enough (``RANK`` is torchrun's; a plain
process is rank 0). Every process still exits with status 2, so that torchrun stops them all (and
prints its own summary of the failed processes after the message).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

USAGE_ERROR = 2  # argparse's exit status for a usage error
RANK0_GRACE_S = 1.0


def exit_with_error(message: str) -> NoReturn:
    """Print ``error: <message>`` on rank 0 and exit every rank with status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:  # torchrun stops every process once one fails: rank 0 gets the time to print first
        time.sleep(RANK0_GRACE_S)
    raise SystemExit(USAGE_ERROR)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a bad choice, a missing value, ``parser.error``) are
    one line from rank 0 (``exit_with_error``) instead of the usage block on every rank."""

    def error(self, message: str) -> NoReturn:
        exit_with_error(message)
