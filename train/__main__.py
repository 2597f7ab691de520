"""The command line: `python -m train` (also installed as `jaxblock`).

    python -m train --config C --workdir W [key.path=value ...]   train (the same command resumes W)
    python -m train evaluate --workdir W                            validation and test accuracy
    python -m train predict --workdir W "text" ...                  label and probability per text
    python -m train diagnose ...                                    the debugging-path checks
    python -m train study-ln ...                                    the Pre-LN vs Post-LN study
    python -m train schema                                          every config key with its default

Exit codes: 0 success; 1 a check failed or the run halted on non-finite values; 2 bad input or usage
(one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NoReturn

USAGE_EXIT = 2
HALT_EXIT = 1

_EPILOG = """\
commands:
  (none)     train: --config C --workdir W [overrides]; rerunning the same command resumes W from its
             latest complete checkpoint; --config may be omitted to continue with W's saved config
  evaluate   --workdir W [--split validation|test|train ...] [--step S]: accuracy and loss
  predict    --workdir W TEXT [TEXT ...]: predicted label and its probability for each text
  diagnose   the debugging-path checks on a config's model or a checkpoint (see diagnose --help)
  study-ln   the Pre-LN vs Post-LN study (see study-ln --help)
  schema     print every config key with its default and description (Markdown)

overrides are dotted key=value pairs parsed as YAML, e.g. model.num_layers=6 optim.lr=3e-4
train.steps=2000 data.source=file data.path=reviews.csv

files in a workdir: config.yaml (resolved config), run.json (versions, devices, git commit per
session), tokenizer/, checkpoints/ (Orbax), metrics.jsonl, tb/ (TensorBoard), curves.png, summary.json

exit codes: 0 success; 1 a check failed or a run halted on non-finite values; 2 bad input or usage
(one line on stderr; an existing workdir is left unchanged)
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: {message} (see --help)\n")


def _train_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train", description="Train a jaxblock classifier from a YAML config.",
                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (see configs/); omit to continue a run with its saved config")
    p.add_argument("--workdir", required=True, help="run directory: created, or resumed if it holds a run")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. optim.lr=3e-4")
    return p


def _evaluate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train evaluate", description="Accuracy and loss of a trained run's checkpoint.")
    p.add_argument("--workdir", required=True, help="a trained run directory")
    p.add_argument("--split", nargs="+", default=["validation", "test"], choices=["train", "validation", "test"])
    p.add_argument("--step", type=int, help="checkpoint step (default: best if kept, else latest)")
    return p


def _predict_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train predict", description="Classify texts with a trained run's checkpoint.")
    p.add_argument("--workdir", required=True, help="a trained run directory")
    p.add_argument("--step", type=int, help="checkpoint step (default: best if kept, else latest)")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="texts to classify")
    return p


def _quiet_libraries() -> None:
    """Keep stderr to our own lines: absl (Orbax) logs warnings that are not the user's concern."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


def cmd_train(argv: list[str]) -> int:
    args = _train_parser().parse_intermixed_args(argv)  # overrides before or after the flags
    from train import run
    from train.parallel import is_primary

    workdir = Path(args.workdir)
    summary = run.train(run.config_for_workdir(args.config, args.overrides, workdir), workdir)
    if not is_primary():  # one process speaks for a multi-host run
        return 0
    if summary.get("preempted"):
        print(f"stopped by signal at step {summary['step']}: checkpoint saved to {summary['checkpoint']}; "
              "rerun the same command to continue")
    else:
        print(run.summary_line(summary))
    return 0


def cmd_evaluate(argv: list[str]) -> int:
    args = _evaluate_parser().parse_args(argv)
    from train.inference import TrainedRun

    trained = TrainedRun.load(args.workdir, args.step)
    for name in args.split:
        result = trained.evaluate(name)
        print(f"{name}: accuracy {result['accuracy']:.4f} loss {result['loss']:.4f} "
              f"({int(result[trained.task.count_name])} {trained.task.count_name})")
    return 0


def cmd_predict(argv: list[str]) -> int:
    args = _predict_parser().parse_args(argv)
    from train.inference import TrainedRun

    predictions = TrainedRun.load(args.workdir, args.step).predict(args.texts)
    for text, prediction in zip(args.texts, predictions, strict=True):
        print(f"{prediction.label}\t{prediction.probability:.4f}\t{text}")
    return 0


def cmd_schema(argv: list[str]) -> int:
    _Parser(prog="python -m train schema", description="Print every config key (Markdown table).").parse_args(argv)
    from train.config import schema_table

    print(schema_table())
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    """Run another command's `main(argv) -> int`, imported only when asked for (it may be heavy)."""
    return int(importlib.import_module(module).main(argv))


def cmd_diagnose(argv: list[str]) -> int:
    return _delegate("train.diagnose", argv)


def cmd_study(argv: list[str]) -> int:
    return _delegate("train.study", argv)


COMMANDS = {"evaluate": cmd_evaluate, "predict": cmd_predict, "schema": cmd_schema, "diagnose": cmd_diagnose,
            "study-ln": cmd_study, "train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        command, argv = COMMANDS[argv[0]], argv[1:]
    else:
        command = cmd_train
    _quiet_libraries()
    from train.checkpoint import CheckpointError
    from train.config import ConfigError
    from train.loop import HaltError
    from train.run import WorkdirError
    from train.sources import DataError

    try:
        return command(argv)
    except (ConfigError, DataError, CheckpointError, WorkdirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT
    except HaltError as err:
        print(f"error: {err}", file=sys.stderr)
        return HALT_EXIT


if __name__ == "__main__":
    sys.exit(main())
