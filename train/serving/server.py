"""`python -m train serve`: an export (or a trained run, exported on the fly) behind a JSON HTTP API.

    python -m train serve --exported runs/sentiment/exported            # http://127.0.0.1:8080
    python -m train serve --workdir runs/sentiment --port 9000
    curl -s localhost:8080/predict -d '{"texts": ["a gripping, funny film"]}'

Endpoints (docs/serving.md): POST /predict {"texts": [...]} -> {"predictions": [{"label", "probability",
"probabilities", "truncated"}]}; POST /embed {"texts": [...]} -> {"embeddings": [[...]], "truncated": [...]};
GET /health -> the model, the queue, the batching counters and the request counts.

The HTTP layer (train/serving/service.py) checks every request before anything is queued.

SIGTERM or Ctrl-C: the listening socket closes, a request that still arrives on an open connection is
refused with a 503 ("shutting down"), every accepted request is answered, then the process prints one
line with the request counts and exits 0 (a second signal exits 130 at once). During the warm-up, it
stops once the compiles in progress end, as any command interrupted during start-up (one line, exit 130).

It binds to 127.0.0.1 unless --host says otherwise, before the warm-up (a port in use is refused at
once), and accepts connections once every shape is compiled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from train.errors import ConfigError, UsageError
from train.interrupts import INTERRUPTED_EXIT, SIGNALS, Interrupted
from train.serving.batcher import Batcher, powers_of_two
from train.serving.service import Engine, Limits, RequestError, Service


class ArtifactEngine:
    """An export (train/serving/artifact.py) behind the batcher."""

    def __init__(self, artifact: Any, batcher: Batcher):
        self.artifact, self.batcher = artifact, batcher

    def describe(self) -> dict[str, Any]:
        a = self.artifact
        source = {k: v for k, v in a.manifest.get("source", {}).items() if k in ("step", "task", "init_from", "model")}
        return {"kind": a.kind, "labels": a.labels, "max_len": a.max_len, "outputs": a.outputs, "source": source,
                **self.batcher.stats()}  # no paths: a client need not learn the server's file layout

    def offers(self, endpoint: str) -> str | None:
        if endpoint == "/predict" and "probabilities" not in self.artifact.outputs:
            return "this export is an encoder: it predicts no labels; POST /embed for its embeddings"
        return None

    async def answer(self, endpoint: str, texts: list[str]) -> dict[str, Any]:
        rows, truncated = self.artifact.encode(texts)
        empty = next((i for i, r in enumerate(rows) if len(r) == 0), None)
        if empty is not None:
            raise RequestError(400, f"texts[{empty}] has no tokens (an empty text): send non-empty texts")
        outputs = await self.batcher.submit(rows)
        if endpoint == "/embed":
            return {"embeddings": [o["embeddings"].tolist() for o in outputs], "truncated": truncated}
        labels = self.artifact.labels
        predictions = []
        for out, cut in zip(outputs, truncated, strict=True):
            probs = out["probabilities"]
            k = int(np.argmax(probs))
            predictions.append({"label": labels[k], "probability": float(probs[k]),
                                "probabilities": {name: float(p) for name, p in zip(labels, probs, strict=True)},
                                "truncated": cut})
        return {"predictions": predictions}

    async def drain(self) -> None:
        await self.batcher.drain()


async def run_server(engine: Engine, *, host: str, port: int, limits: Limits, drain_timeout_s: float = 60.0,
                     on_ready: Callable[[str], None] | None = None,
                     warm: Callable[[threading.Event], Awaitable[Any]] | None = None,
                     say: Callable[[str], None] | None = None) -> int:
    """Bind host:port (ConfigError at once when it is taken), warm, listen; serve until SIGTERM or SIGINT,
    drain, return the exit code (0; 130 on a second signal). A signal during the warm-up sets the event
    `warm` is given, and once `warm` returns raises Interrupted: the command's start-up was interrupted."""
    from aiohttp import web

    service = Service(engine, limits, say)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    halt_warm_up = threading.Event()
    signals: list[str] = []
    serving = False
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def on_signal(signum: int) -> None:
        signals.append(signal.Signals(signum).name)
        if len(signals) > 1:
            service.say(f"{signals[-1]} again: stopping now, " + (f"{service.counts.in_flight} requests unanswered"
                                                                   if serving else "during the warm-up"))
            sys.stderr.flush()
            os._exit(INTERRUPTED_EXIT)
        if not serving:  # nothing to drain: the warm-up ends after the compiles in progress
            halt_warm_up.set()
            return
        service.say(f"{signals[-1]}: draining {service.counts.in_flight} requests in flight, "
                    "refusing new ones (again to stop now)")
        stop.set()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        runner = web.AppRunner(service.app(), access_log=None, handle_signals=False,
                               shutdown_timeout=drain_timeout_s)
        await runner.setup()
        assert runner.server is not None
        try:  # bound now, listening once warm: a busy port is refused at once, not after the warm-up
            listener = await loop.create_server(runner.server, host, port, backlog=1024, start_serving=False)
        except OSError as err:
            await runner.cleanup()
            why = os.strerror(err.errno) if err.errno and err.errno > 0 else err.strerror or str(err)
            raise ConfigError(f"cannot listen on {host}:{port} ({why}): pass another --port or --host") from None
        try:
            if warm is not None:
                await warm(halt_warm_up)
                # A signal sent while the last compile ran can be read from the loop's wake-up pipe in the turn
                # that completes the warm-up, its handler queued behind our resumption: yield once so it runs first.
                await asyncio.sleep(0)
            if halt_warm_up.is_set():
                raise Interrupted(signals[0])
            serving = True  # with no await since the check: a signal from here on drains
            await listener.start_serving()
            url = f"http://{host if ':' not in host else f'[{host}]'}:{listener.sockets[0].getsockname()[1]}"
            if on_ready is not None:
                on_ready(url)
            await stop.wait()
            service.draining = True
            listener.close()  # no new connections; open ones get a 503 until they close
            deadline = loop.time() + drain_timeout_s
            while service.counts.in_flight > 0 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            await engine.drain()
        finally:
            listener.close()
            await runner.cleanup()
        c = service.counts
        service.say(f"stopped: {c.accepted} requests accepted, {c.answered} answered, {c.refused} refused, {c.gone} "
                    f"clients gone before their answer, {c.in_flight} unanswered")
        return 0
    finally:
        for sig in SIGNALS:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
            if previous[sig] is not None:  # the command's own policy (train/interrupts.py), as before the server
                signal.signal(sig, previous[sig])


# --- the command --------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    from train.cli import Parser, program

    p = Parser(prog=f"{program()} serve", description="Serve an export (or a trained run) as a JSON HTTP API with "
               "dynamic batching: POST /predict, POST /embed, GET /health (docs/serving.md).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--exported", help="a directory written by python -m train export, or the run's workdir "
                        "that holds it (WORKDIR/exported)")
    source.add_argument("--workdir", help="a trained run: exported for this machine's platform at start")
    p.add_argument("--step", type=int, help="with --workdir: the checkpoint (default: best if kept, else latest)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--batching", choices=["dynamic", "off"], default="dynamic",
                   help="dynamic: concurrent requests share batches (default); off: each request runs alone")
    p.add_argument("--max-batch", type=_positive(int), default=32, help="rows in one model run (default: %(default)s)")
    p.add_argument("--lengths", type=_int_list, help="token lengths compiled and warmed, comma-separated (default: "
                   "the run's own length buckets, from the export's manifest)")
    p.add_argument("--max-queue", type=_positive(int), default=512,
                   help="rows waiting at most; a request beyond gets a 503 (default: %(default)s)")
    p.add_argument("--max-texts", type=_positive(int), default=64, help="texts per request (default: %(default)s)")
    p.add_argument("--max-chars", type=_positive(int), default=2000, help="characters per text (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=_positive(int), default=1 << 20, help="request body (default: 1 MiB)")
    p.add_argument("--drain-timeout", type=_positive(float), default=60.0,
                   help="seconds SIGTERM waits for requests in flight (default: %(default)s)")
    return p


def _platform() -> str:
    import jax

    return {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())


def load_engine(args: argparse.Namespace, scratch: Path) -> ArtifactEngine:
    """The export --exported names (or the one in the run's workdir it names), or --workdir's run exported
    into `scratch` for this platform."""
    from train import export
    from train.serving.artifact import MANIFEST_FILE, Artifact

    directory = Path(args.exported) if args.exported else scratch / "exported"
    if args.exported and not (directory / MANIFEST_FILE).is_file():
        from train.checkpoints.store import CONFIG_FILE

        if (directory / export.DEFAULT_DIR / MANIFEST_FILE).is_file():
            directory = directory / export.DEFAULT_DIR  # a run's workdir: the export `export --workdir` wrote there
        elif (directory / CONFIG_FILE).is_file():
            raise ConfigError(f"--exported {directory} is a run's workdir with no export in it: serve it with "
                              f"--workdir {directory} (exported at start), or run python -m train export "
                              f"--workdir {directory} first")
    if args.workdir:
        if not Path(args.workdir).is_dir():
            raise ConfigError(f"workdir {args.workdir} does not exist: pass the --workdir of a trained run")
        export.write_export(export.from_workdir(Path(args.workdir), args.step), directory, [_platform()])
    artifact = Artifact.load(directory)
    lengths = args.lengths or [n for n in artifact.manifest.get("buckets", []) if n <= artifact.max_len] or \
        powers_of_two(artifact.max_len, start=min(16, artifact.max_len))
    if max(lengths) > artifact.max_len:
        raise UsageError(f"--lengths {','.join(map(str, lengths))}: the export reads at most {artifact.max_len} tokens")
    if max(lengths) < artifact.max_len:
        lengths = [*lengths, artifact.max_len]  # a text truncated to max_len must fit a compiled shape
    batcher = Batcher(artifact.run, pad_id=artifact.pad_id, lengths=lengths,
                      batch_sizes=powers_of_two(args.max_batch), max_queue=args.max_queue,
                      dynamic=args.batching == "dynamic")
    return ArtifactEngine(artifact, batcher)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.max_queue < args.max_texts:
        raise UsageError(f"--max-queue {args.max_queue} is below --max-texts {args.max_texts}: a full request could "
                         "never be queued")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="jaxblock-serve-") as scratch:
        engine = load_engine(args, Path(scratch))
        batcher = engine.batcher
        limits = Limits(args.max_texts, args.max_chars, args.max_body_bytes)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            say(f"note: binding to {args.host}, not loopback: anyone who reaches this address can use the model")

        async def warm(stop: threading.Event) -> None:
            shapes = batcher.shapes()
            say(f"compiling {len(shapes)} shapes ({len(batcher.batch_sizes)} batch sizes x lengths "
                f"{','.join(map(str, batcher.lengths))}) ...")
            seconds = await asyncio.get_running_loop().run_in_executor(None, lambda: batcher.warm(say, stop=stop))
            if not stop.is_set():
                say(f"compiled in {seconds:.0f}s")
                batcher.start()

        def ready(url: str) -> None:
            a = engine.artifact
            what = f"a classifier ({', '.join(a.labels)})" if a.kind == "classifier" else "an encoder"
            print(f"serving {what} from {a.directory} on {url}: POST /predict, POST /embed, GET /health "
                  f"(batching {'dynamic' if batcher.dynamic else 'off'}; Ctrl-C or SIGTERM drains and stops)",
                  flush=True)

        return asyncio.run(run_server(engine, host=args.host, port=args.port, limits=limits,
                                      drain_timeout_s=args.drain_timeout, on_ready=ready, warm=warm, say=say))
