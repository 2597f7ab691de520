"""Every snippet in README.md and docs/ stays true: Python blocks run, and every `python -m train ...` command
shown is accepted by the CLI (its flags by the command's parser, its config file and overrides by the config
schema), without training anything.

A Python block that cannot run here says why on the line before it: `<!-- not run: REASON -->`; one that
runs but is heavy (imports PyTorch, say) is marked `<!-- slow: REASON -->` and runs in the slow suite.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from train import __main__ as cli
from train import diagnose, embed, export, study, verify
from train.aot import lower
from train.config import ConfigError, load_config
from train.serving import server

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARK = re.compile(r"<!-- (not run|slow): (.+?) -->\n*$")


def _python_blocks() -> list[tuple[str, str, str | None, str]]:
    """(page, code, mark, reason) of every ```python block of the docs pages (README's is test_readme's)."""
    found = []
    for page in PAGES[1:]:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL):
            mark = _MARK.search(text[: match.start()])
            found.append((page.name, match.group(1), mark.group(1) if mark else None, mark.group(2) if mark else ""))
    return found


BLOCKS = _python_blocks()


def _run_block(page: str, code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs/{page}", "exec"), {"__name__": f"docs_{page}"})
    return out.getvalue()


def test_the_docs_hold_python_blocks_and_each_unrun_one_says_why():
    assert {page for page, *_ in BLOCKS} >= {"model.md", "interop.md", "training.md"}, BLOCKS
    for page, _code, mark, reason in BLOCKS:
        assert mark in (None, "slow") or len(reason.split()) >= 3, f"{page}: say why a block does not run"


@pytest.mark.parametrize("page,code", [(p, c) for p, c, mark, _ in BLOCKS if mark is None],
                         ids=lambda v: v if v.endswith(".md") else "")
def test_a_docs_python_block_runs(page, code):
    assert _run_block(page, code).strip(), f"{page}: a runnable block should print what it shows"


@pytest.mark.slow
@pytest.mark.parametrize("page,code", [(p, c) for p, c, mark, _ in BLOCKS if mark == "slow"],
                         ids=lambda v: v if v.endswith(".md") else "")
def test_a_heavy_docs_python_block_runs(page, code):
    assert _run_block(page, code).strip(), f"{page}: a runnable block should print what it shows"


# Placeholders the pages use for "your own value", and what stands in for them here.
_PLACEHOLDERS = {"...": "--config configs/sentiment.yaml --workdir runs/example", "C": "configs/sentiment.yaml",
                 "=N": "=2", "=I": "=0"}


def _train_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every `python -m train` command in a code block or code span of the pages (a bare
    `python -m train` in prose names the program, not a command)."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fenced = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
                  if lang in ("bash", "sh", "")]
        spans = re.findall(r"`(python -m train(?![.\w])[^`]*)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
        lines = [ln for block in fenced for ln in block.replace("\\\n", " ").splitlines()]
        for line in [*lines, *(" ".join(span.split()) for span in spans)]:
            for tail in re.findall(r"python -m train(?![.\w])([^`'#<|&\\]*)", line):
                words = [re.sub(r"=[NI]$", lambda m: _PLACEHOLDERS[m.group(0)], w) for w in shlex.split(tail)]
                argv = [part for w in words for part in (_PLACEHOLDERS[w].split() if w in ("...", "C") else [w])]
                if argv:
                    found.append((page.name, argv))
    return found


COMMANDS = _train_commands()


def _accepted(argv: list[str]) -> None:
    """Parse argv as `python -m train` would and validate its config and overrides; raise on refusal."""
    command = argv[0] if argv and argv[0] in cli.COMMANDS else "train"
    rest = argv[1:] if command != "train" or argv[:1] == ["train"] else argv
    if command == "train":
        args = cli._train_parser().parse_intermixed_args(rest)
        load_config(args.config, args.overrides)
    elif command == "evaluate":
        overrides = [a for a in rest if "=" in a and not a.startswith("-")]
        cli._evaluate_parser().parse_args([a for a in rest if a not in overrides])
        load_config(None, overrides)
    elif command == "predict":
        cli._predict_parser().parse_args(rest)
    elif command == "diagnose":
        args = diagnose._parser().parse_args(rest)
        load_config(args.config, args.overrides)
    elif command == "study-ln":
        study._parser().parse_args(rest)
    elif command == "embed":
        embed._parser().parse_args(rest)
    elif command == "verify":
        verify._parser().parse_args(rest)
    elif command == "export":
        export._parser().parse_args(rest)
    elif command == "serve":
        server._parser().parse_args(rest)
    elif command == "lower":
        if rest:  # a bare `python -m train lower` in prose names the command
            args = lower._parser().parse_intermixed_args(rest)
            load_config(args.config, args.overrides)
    else:
        assert command == "schema" and not rest, argv


def test_the_pages_show_the_commands_of_every_kind():
    kinds = {argv[0] if argv and argv[0] in cli.COMMANDS else "train" for _, argv in COMMANDS}
    assert kinds >= {"train", "evaluate", "predict", "diagnose", "study-ln", "schema", "embed", "verify"}, kinds
    assert len(COMMANDS) >= 30, COMMANDS


@pytest.mark.parametrize("page,argv", COMMANDS, ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_a_shown_train_command_is_accepted_by_the_cli(page, argv):
    try:
        _accepted(argv)
    except SystemExit as stop:  # argparse refused it (the one-line usage error is on stderr)
        pytest.fail(f"{page}: `python -m train {' '.join(argv)}` is refused by the parser (exit {stop.code})")
    except ConfigError as err:
        pytest.fail(f"{page}: `python -m train {' '.join(argv)}`: {err}")


def test_the_check_refuses_a_wrong_command():
    """The check above can fail: a misspelt flag, an unknown key and a wrong value type are all refused."""
    for argv in (["--confg", "configs/tiny.yaml", "--workdir", "w"],
                 ["--config", "configs/tiny.yaml", "--workdir", "w", "optim.learning_rate=1"],
                 ["evaluate", "--workdir", "w", "train.steps=many"]):
        with pytest.raises((SystemExit, ConfigError)), contextlib.redirect_stderr(io.StringIO()):
            _accepted(argv)
