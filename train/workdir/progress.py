"""The progress bar (tqdm) and the run's own lines on the terminal."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    """A tqdm bar on stderr with loss/accuracy/tokens per second; its ETA comes from tqdm."""

    def __init__(self, total: int, start: int, *, bar: bool, lines: bool, stream: Any = None):
        """bar: show the bar; lines: print `write` lines (False on non-primary processes: they say nothing);
        stream: where both go (default sys.stderr)."""
        self.lines = lines
        self.stream = stream if stream is not None else sys.stderr
        self.bar = tqdm(total=total, initial=start, disable=not bar, file=self.stream, unit="step",
                        dynamic_ncols=True, leave=True)

    def update(self, steps: int, values: dict[str, float]) -> None:
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
        self.bar.update(steps)

    def write(self, line: str) -> None:
        if self.lines:
            self.bar.write(line, file=self.stream)

    def close(self) -> None:
        self.bar.close()
