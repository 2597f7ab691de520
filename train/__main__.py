"""The command line: `python -m train`, run from the checkout (only the `jaxblock` library is installed).

    python -m train --config C --workdir W [key.path=value ...]   train (the same command resumes W)
    python -m train evaluate --workdir W                            validation and test accuracy
    python -m train predict --workdir W "text" ...                  label and probability per text
    python -m train diagnose ...                                    the debugging-path checks
    python -m train study-ln ...                                    the Pre-LN vs Post-LN study
    python -m train schema                                          every config key with its default
    python -m train embed --model hf:<dir|name> --out F.npy ...       sentence embeddings (train/embed.py)
    python -m train verify --workdir W                              read every checkpoint back, write nothing
    python -m train export --workdir W [--out DIR]                  a jax.export artifact (train/export.py)
    python -m train serve (--exported DIR | --workdir W)            JSON HTTP predict/embed (train/serving/)
    python -m train lower --config C --platform tpu|cuda            its steps as StableHLO, kernels checked (train/aot/)
    python -m train compile --config C --target v5e-8|h100-8|...     will it fit on my slice (train/aot/compile.py)

Exit codes: 0 success; 1 a check failed or the run halted on non-finite values; 2 bad input, usage, a busy
workdir, a damaged checkpoint or a full disk (one line on stderr, nothing already written lost); 130
interrupted (Ctrl-C/SIGTERM outside the training loop, or a second one inside it; see train/interrupts.py).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from train.cli import Parser as _Parser  # the parser's public home is train/cli.py
from train.cli import one_line, program
from train.errors import EXIT_CODES, ONE_LINE_ERRORS, USAGE_EXIT, DataError, DiskFullError

_EPILOG = """\
commands:
  (none)     train: --config C --workdir W [overrides]; rerunning the same command resumes W from its
             latest complete checkpoint; --config may be omitted to continue with W's saved config
  evaluate   --workdir W [--split validation|test|train ...] [--step S] [key=value ...]: the task's
             metrics (accuracy and loss for classification); overrides fix what changed since training,
             e.g. data.path=/new/place/reviews.csv
  predict    --workdir W [--step S] [--json] (TEXT ... | - | --file F): label and probability per text;
             `-` reads standard input and --file a file, one text per line
  diagnose   the debugging-path checks on a config's model or a checkpoint (see diagnose --help)
  study-ln   the Pre-LN vs Post-LN study (see study-ln --help)
  schema     print every config key with its default and description (Markdown)
  embed      --model hf:<dir>|hf:all-MiniLM-L6-v2 (TEXT ... | --input F|-) --out F.npy|F.jsonl: sentence
             embeddings pooled the checkpoint's own way (see embed --help)
  verify     --workdir W [--json]: read every checkpoint back and report, per step, whether it restores
             and what is damaged, moving nothing (exit 0 all restore, 1 some damaged, 2 bad input)
  export     --workdir W [--out DIR] [--platforms cpu,cuda,tpu] [--format jax|hf]: the run's inference as a
             jax.export artifact that loads with jax, flatbuffers, numpy and tokenizers, or a transformers directory
  serve      (--exported DIR | --workdir W) [--host 127.0.0.1] [--port P]: JSON HTTP predict, embed and health
             with dynamic batching (docs/serving.md)
  lower      --config C --platform tpu|cuda [--devices 8] [--layout dp|fsdp|tp|...] [--out DIR] [key=value ...]:
             lower the train step and inference to StableHLO for the platform on an abstract mesh, here, and
             print per layer the attention kernel and whether it is in the lowered program (exit 0 all kernels
             found, 1 one missing or not traceable here, 2 bad input)
  compile    --config C --target v5e-8|v4-8|v5p-128|v6e-64|h100-8|... [--layout L] [--slices S] [--fit]
             [--save FILE] [--json] [key=value ...]: compile the steps with the chip's own compiler, here,
             without the chip: memory per chip against its usable memory, kernels per layer, collectives
             (exit 0 fits, 1 does not fit or a kernel is missing, 2 bad input or no compiler installed)

overrides are dotted key=value pairs parsed as YAML, e.g. model.num_layers=6 optim.lr=3e-4
train.steps=2000 data.source=file data.path=reviews.csv

files in a workdir: config.yaml (resolved config), run.json (versions, devices, git commit per
session), tokenizer/, checkpoints/ (Orbax), metrics.jsonl, tb/ (TensorBoard), curves.png, summary.json

exit codes: 0 success (also a run stopped by one Ctrl-C/SIGTERM: it saved; rerun to continue); 1 a check
failed or a run halted on non-finite values; 2 bad input or usage, a workdir in use by another run, a
damaged checkpoint with no good one, a full disk (one line on stderr; nothing already written is lost);
130 interrupted before training started, or a second Ctrl-C (the last complete checkpoint stays intact)
"""


def _train_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=program(), description="Train a jaxblock classifier from a YAML config.",
                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (see configs/); omit to continue a run with its saved config")
    p.add_argument("--workdir", required=True, help="run directory: created, or resumed if it holds a run")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. optim.lr=3e-4")
    return p


def _evaluate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{program()} evaluate", description="Accuracy and loss of a trained run's checkpoint.")
    p.add_argument("--workdir", required=True, help="a trained run directory")
    p.add_argument("--split", nargs="+", default=["validation", "test"], choices=["train", "validation", "test"])
    p.add_argument("--step", type=int, help="checkpoint step (default: best if kept, else latest)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="change the saved config for this evaluation, e.g. data.path=/moved/reviews.csv")
    return p


def _predict_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{program()} predict", description="Classify texts with a trained run's checkpoint.")
    p.add_argument("--workdir", required=True, help="a trained run directory")
    p.add_argument("--step", type=int, help="checkpoint step (default: best if kept, else latest)")
    p.add_argument("--file", help="classify each line of this file (one text per line)")
    p.add_argument("--json", action="store_true", help="one JSON object per text instead of a table")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to classify; - reads them from standard input")
    return p


def _quiet_libraries() -> None:
    """Keep stderr to our own lines: absl (Orbax) logs warnings that are not the user's concern."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


def cmd_train(argv: list[str], interrupts: Any = None) -> int:
    args = _train_parser().parse_intermixed_args(argv)  # overrides before or after the flags
    from train import run
    from train.devices.hosts import is_primary

    workdir = Path(args.workdir)
    summary = run.train(run.config_for_workdir(args.config, args.overrides, workdir), workdir, interrupts=interrupts)
    if not is_primary():  # one process speaks for a multi-host run
        return 0
    if summary.get("preempted"):
        print(f"stopped by signal at step {summary['step']}: checkpoint saved to {summary['checkpoint']}; "
              "rerun the same command to continue")
    else:
        print(run.summary_line(summary))
    return 0


def cmd_evaluate(argv: list[str], interrupts: Any = None) -> int:
    # key=value words are overrides wherever they stand (also after --split's list of names).
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = _evaluate_parser().parse_args([a for a in argv if a not in overrides])
    args.overrides = overrides
    from train.inference import TrainedRun
    from train.tasks import metric_names

    trained = TrainedRun.load(args.workdir, args.step, overrides=args.overrides)
    for note in trained.notes:
        print(note, file=sys.stderr)
    for name in args.split:
        result = trained.evaluate(name)
        shown = " ".join(f"{metric} {result[metric]:.4f}" for metric in metric_names(trained.task))
        print(f"{name}: {shown} ({int(result[trained.task.count_name])} {trained.task.count_name}, "
              f"checkpoint {trained.step})")
    return 0


def _read_texts(args: argparse.Namespace) -> list[str]:
    texts: list[str] = []
    for text in args.texts:
        texts += sys.stdin.read().splitlines() if text == "-" else [text]
    if args.file is not None:
        try:
            texts += Path(args.file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read --file {args.file} ({getattr(err, 'strerror', None) or err}): pass a "
                            "readable UTF-8 text file, one text per line") from None
    if not texts:
        raise DataError("no text to classify: pass texts, - (standard input) or --file F")
    return texts


def cmd_predict(argv: list[str], interrupts: Any = None) -> int:
    args = _predict_parser().parse_args(argv)
    texts = _read_texts(args)
    from train.inference import TrainedRun

    trained = TrainedRun.load(args.workdir, args.step)
    for note in trained.notes:
        print(note, file=sys.stderr)
    predictions = trained.predict(texts, strict=False)
    if not args.json:
        print("label\tprobability\ttruncated\ttext")
    for text, p in zip(texts, predictions, strict=True):
        if args.json:
            print(json.dumps({"text": text, "label": p.label, "probability": p.probability,
                              "probabilities": p.probabilities, "truncated": p.truncated, "error": p.error}))
        elif p.error:
            print(f"-\t-\t-\t{text}\t(error: {p.error})")
        else:
            print(f"{p.label}\t{p.probability:.4f}\t{'yes' if p.truncated else 'no'}\t{text}")
    return 0


def cmd_schema(argv: list[str], interrupts: Any = None) -> int:
    _Parser(prog=f"{program()} schema", description="Print every config key (Markdown table).").parse_args(argv)
    from train.config import schema_table

    print(schema_table())
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    """Run another command's `main(argv) -> int`, imported only when asked for (it may be heavy)."""
    return int(importlib.import_module(module).main(argv))


def cmd_diagnose(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.diagnose", argv)


def cmd_study(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.study", argv)


def cmd_embed(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.embed", argv)


def cmd_verify(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.verify", argv)


def cmd_export(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.export", argv)


def cmd_serve(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.serving.server", argv)


def cmd_lower(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.aot.lower", argv)


def cmd_compile(argv: list[str], interrupts: Any = None) -> int:
    return _delegate("train.aot.compile", argv)


COMMANDS = {"evaluate": cmd_evaluate, "predict": cmd_predict, "schema": cmd_schema, "diagnose": cmd_diagnose,
            "study-ln": cmd_study, "embed": cmd_embed, "verify": cmd_verify, "train": cmd_train,
            "export": cmd_export, "serve": cmd_serve, "lower": cmd_lower, "compile": cmd_compile}


def _unknown_command(argv: list[str]) -> str | None:
    """A first word that is neither a flag, an override (key=value) nor a command: a misspelt command."""
    if not argv or argv[0].startswith("-") or "=" in argv[0] or argv[0] in COMMANDS:
        return None
    close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (commands: {', '.join(COMMANDS)})"
    return f"{program()}: unknown command '{argv[0]}'{hint}"


def _silence_exit_noise() -> None:
    """After the one line: Orbax's failed save threads log their tracebacks as the process ends."""
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


def _stdout_closed() -> int:
    """The reader of our output left (`... | head`): stop quietly, as a Unix tool does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    return 0


def _interrupted_early(signum: int, frame: Any) -> None:
    print(f"interrupted during start-up ({signal.Signals(signum).name}): nothing was written", file=sys.stderr)
    os._exit(130)


def main(argv: list[str] | None = None) -> int:
    whole_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        # Until the command's own policy is installed (train.interrupts), while the libraries import.
        previous = {sig: signal.signal(sig, _interrupted_early) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv, whole_process)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str], whole_process: bool) -> int:
    unknown = _unknown_command(argv)
    if unknown:
        print(one_line(unknown), file=sys.stderr)
        return USAGE_EXIT
    if argv and argv[0] in COMMANDS:
        command, argv = COMMANDS[argv[0]], argv[1:]
    else:
        command = cmd_train
    if whole_process:  # before JAX loads: the platforms this host has (train/platforms.py)
        from train import platforms

        name = next((name for name, fn in COMMANDS.items() if fn is command), "train")
        if name in platforms.AHEAD_OF_TIME:  # a native crash or refusal is one line (train/aot/isolate.py)
            from train.aot import isolate

            if not isolate.is_child():
                return isolate.run([sys.executable, "-m", "train", name, *argv], json_out="--json" in argv,
                                   doing="compiling" if name == "compile" else "lowering")
            isolate.child_setup()
        platforms.choose(name)
        if name in platforms.AHEAD_OF_TIME:
            platforms.start_jax(filtered=False)  # the parent passes native lines on, filtered (isolate.run)
    _quiet_libraries()
    from train.interrupts import RESUMABLE, run_interruptible

    def run(interrupts: Any) -> int:
        try:
            code = command(argv, interrupts)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            return _stdout_closed()
        except ONE_LINE_ERRORS as err:
            if isinstance(err, DiskFullError):
                # Libraries flush their files on the full disk once more at exit (tensorboardX's atexit
                # hook) and Python prints each failure as "Exception ignored in ...": the line below says it.
                sys.unraisablehook = lambda unraisable: None
            print(one_line(f"error: {err}"), file=sys.stderr)
            if isinstance(err, DiskFullError) and whole_process:
                _silence_exit_noise()
            return next(code for kind, code in EXIT_CODES.items() if isinstance(err, kind))

    no_workdir = command in (cmd_compile, cmd_lower, cmd_schema, cmd_embed)
    return run_interruptible(run, after=None if no_workdir else RESUMABLE)


if __name__ == "__main__":
    from train.host_memory import reexec_with_huge_pages

    reexec_with_huge_pages()  # huge pages for XLA's per-step buffers (train/host_memory.py); before jax loads
    sys.exit(main())
