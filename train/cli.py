"""What every `python -m train` command shares on the command line: the program's name, one-line messages,
and an argparse parser whose usage errors are one line (exit 2) instead of usage plus a message."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from train.errors import USAGE_EXIT


def program() -> str:
    """The name the user typed: `python -m train`, or the script's own name when a wrapper script runs `main`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "python -m train" if name in ("", "__main__.py", "-c", "-m") or name.startswith("python") else name


def one_line(text: object) -> str:
    """A message as one printable line: user input echoed in it (an override holding a control or
    line-separator character) is shown escaped instead of breaking the line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text).strip())


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, one_line(f"{self.prog}: {message} (see --help)") + "\n")
