"""Argument types for the bench commands (a value argparse refuses in its one usage line, exit 2) and their
exit on Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T", int, float)


def checked(cast: Callable[[str], T], accepts: Callable[[T], bool], wanted: str) -> Callable[[str], T]:
    """An argparse `type`: `cast` the text, then require `accepts(value)`; otherwise "'x' is not <wanted>"."""

    def parse(text: str) -> T:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}") from None
        if not accepts(value):  # NaN fails every comparison, so it is refused too
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value

    return parse


count = checked(int, lambda v: v >= 1, "a count: pass a positive integer")


def exit_process(code: int) -> NoReturn:
    """A command's `sys.exit(main())`, except after Ctrl-C (130): straight out with os._exit. Interrupted
    inside an XLA compile, the interpreter's normal teardown crashed with SIGSEGV after the command's own
    last line; the commands have nothing left to write or clean up by then."""
    if code != 130:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
