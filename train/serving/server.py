"""`python -m train serve`: an export (or a trained run, exported on the fly) behind a JSON HTTP API.

    python -m train serve --exported runs/sentiment/exported            # http://127.0.0.1:8080
    python -m train serve --workdir runs/sentiment --port 9000
    curl -s localhost:8080/predict -d '{"texts": ["a gripping, funny film"]}'

Endpoints (docs/serving.md): POST /predict {"texts": [...]} -> {"predictions": [{"label", "probability",
"probabilities", "truncated"}]}; POST /embed {"texts": [...]} -> {"embeddings": [[...]], "truncated": [...]};
GET /health -> the model, the queue, the batching counters and the request counts.

The HTTP layer is aiohttp: one asyncio library that brings the server and the client the load bench and the
tests use, with the body-size limit (client_max_size) and a runner whose listening socket can be closed
while requests in flight finish, which the drain needs. Requests are checked before anything is queued: a
body over --max-body-bytes, bad JSON, a missing or empty "texts" list, a text that is not a string or not
valid Unicode, more than --max-texts texts or more than --max-chars characters in one, a text with no
tokens, an unknown path or method: each is a 4xx with a one-line JSON body {"error": "..."}. A full
queue is a 503 with Retry-After. Nothing a client sends reaches the model unchecked; an unexpected
failure is a 500 with one line, and the server goes on.

SIGTERM or Ctrl-C: the listening socket closes, a request that still arrives on an open connection is
refused with a 503 ("shutting down"), every accepted request is answered, then the process prints one
line with the request counts and exits 0 (a second signal exits 130 at once). It binds to 127.0.0.1
unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from train.errors import ConfigError, UsageError
from train.serving.batcher import Batcher, ClosedError, QueueFullError, powers_of_two

ENDPOINTS = ("/predict", "/embed")


class RequestError(Exception):
    """A request the server refuses: its HTTP status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    max_texts: int = 64
    max_chars: int = 2000
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0


@dataclass
class Counts:
    """API requests (predict and embed): accepted = answered + refused + gone + in flight."""

    accepted: int = 0
    answered: int = 0  # 200
    refused: int = 0  # a 4xx or 5xx with its one line
    gone: int = 0  # the client left before its answer was written
    by_status: dict[int, int] = field(default_factory=dict)  # of the answered and refused

    @property
    def in_flight(self) -> int:
        return self.accepted - self.answered - self.refused - self.gone

    def as_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "answered": self.answered, "refused": self.refused, "gone": self.gone,
                "in_flight": self.in_flight, "by_status": {str(k): v for k, v in sorted(self.by_status.items())}}


class Engine(Protocol):
    """What the HTTP layer serves: a model that answers whole requests."""

    def describe(self) -> dict[str, Any]: ...
    def offers(self, endpoint: str) -> str | None: ...  # None, or why this model has no such endpoint
    async def answer(self, endpoint: str, texts: list[str]) -> dict[str, Any]: ...
    async def drain(self) -> None: ...


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


# --- the HTTP layer -----------------------------------------------------------------------------


def _error(status: int, message: str, **headers: str) -> Any:
    from aiohttp import web

    return web.Response(status=status, text=json.dumps({"error": message}) + "\n", content_type="application/json",
                        headers=headers)


def _texts(body: bytes, limits: Limits) -> list[str]:
    """The request's texts, or a RequestError naming what is wrong."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
        raise RequestError(400, f"the body is not JSON ({err.__class__.__name__}): send "
                                '{"texts": ["a text", ...]}') from None
    if not isinstance(payload, dict) or "texts" not in payload:
        raise RequestError(400, 'the body has no "texts": send {"texts": ["a text", ...]}')
    texts = payload["texts"]
    if not isinstance(texts, list) or not texts:
        raise RequestError(400, '"texts" must be a non-empty list of strings')
    if len(texts) > limits.max_texts:
        raise RequestError(413, f'"texts" has {len(texts)} texts, over the limit of {limits.max_texts} a request: '
                                "split it")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise RequestError(400, f"texts[{i}] is a {type(text).__name__}, not a string")
        if len(text) > limits.max_chars:
            raise RequestError(413, f"texts[{i}] has {len(text)} characters, over the limit of {limits.max_chars}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, f"texts[{i}] is not valid Unicode (a lone surrogate)") from None
    return texts


class Service:
    """The aiohttp application around an engine, its limits, counters and drain state."""

    def __init__(self, engine: Engine, limits: Limits, say: Callable[[str], None] | None = None):
        self.engine, self.limits = engine, limits
        self.counts = Counts()
        self.draining = False
        self.started = time.time()
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(middlewares=[self._guard], client_max_size=self.limits.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_post("/predict", self._api)
        app.router.add_post("/embed", self._api)
        return app

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        body = {"status": "draining" if self.draining else "ok", "uptime_s": round(time.time() - self.started, 1),
                "requests": self.counts.as_dict(), **self.engine.describe()}
        return web.json_response(body, status=503 if self.draining else 200, dumps=lambda x: json.dumps(x) + "\n")

    async def _api(self, request: Any) -> Any:
        from aiohttp import web

        why = self.engine.offers(request.path)
        if why is not None:
            raise RequestError(404, why)
        if request.content_length is not None and request.content_length > self.limits.max_body_bytes:
            raise RequestError(413, f"the body has {request.content_length} bytes, over the limit of "
                                    f"{self.limits.max_body_bytes} bytes")
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                body = await request.read()
        except TimeoutError:
            raise RequestError(408, f"the body did not arrive within {self.limits.body_timeout_s:.0f}s") from None
        texts = _texts(body, self.limits)
        try:
            result = await self.engine.answer(request.path, texts)
        except QueueFullError:
            raise RequestError(503, "the queue is full: retry in a moment") from None
        except ClosedError:
            raise RequestError(503, "the server is shutting down: retry on another instance") from None
        return web.Response(text=json.dumps(result) + "\n", content_type="application/json")

    @property
    def _guard(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            api = request.path in ENDPOINTS and request.method == "POST"
            if api:
                self.counts.accepted += 1
            try:
                if api and self.draining:
                    raise RequestError(503, "the server is shutting down: retry on another instance")
                response = await handler(request)
            except RequestError as err:
                headers = {"Retry-After": "1"} if err.status == 503 else {}
                if self.draining:
                    headers["Connection"] = "close"
                response = _error(err.status, str(err), **headers)
            except web.HTTPException as err:  # aiohttp's own: unknown path, method, body over client_max_size
                message = {404: f"no endpoint {request.path}: use POST /predict, POST /embed or GET /health",
                           405: f"{request.method} is not allowed on {request.path}",
                           413: f"the body is over the limit of {self.limits.max_body_bytes} bytes"}
                response = _error(err.status, message.get(err.status, err.reason))
            except ConnectionError:  # the client left while its body was arriving: nobody to answer
                response = _error(400, "the connection closed before the request arrived")
            except Exception as err:  # never the server's end: one line to the client and to the log
                self.say(f"error: {request.method} {request.path}: {err.__class__.__name__}: {err}")
                response = _error(500, f"internal error ({err.__class__.__name__}): the request was not served")
            if api:
                transport = request.transport
                if transport is None or transport.is_closing():
                    self.counts.gone += 1
                    return response
                if response.status < 400:
                    self.counts.answered += 1
                else:
                    self.counts.refused += 1
                self.counts.by_status[response.status] = self.counts.by_status.get(response.status, 0) + 1
            return response

        return guard


async def run_server(engine: Engine, *, host: str, port: int, limits: Limits, drain_timeout_s: float = 60.0,
                     on_ready: Callable[[str], None] | None = None, warm: Callable[[], Any] | None = None,
                     say: Callable[[str], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, drain, return the exit code (0; 130 on a second signal)."""
    from aiohttp import web

    service = Service(engine, limits, say)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            service.say(f"{signal.Signals(signum).name} again: stopping now, {service.counts.in_flight} requests "
                        "unanswered")
            sys.stderr.flush()
            import os

            os._exit(130)
        service.say(f"{signal.Signals(signum).name}: draining {service.counts.in_flight} requests in flight, "
                    "refusing new ones (again to stop now)")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        if warm is not None:
            await warm()
            if stop.is_set():
                return 0
        runner = web.AppRunner(service.app(), access_log=None, handle_signals=False,
                               shutdown_timeout=drain_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}): pass another --port or --host"
                              ) from None
        bound = runner.addresses[0][1] if runner.addresses else port
        url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
        service.draining = True
        await site.stop()  # no new connections; open ones get a 503 until they close
        deadline = loop.time() + drain_timeout_s
        while service.counts.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await engine.drain()
        await runner.cleanup()
        c = service.counts
        service.say(f"stopped: {c.accepted} requests accepted, {c.answered} answered, {c.refused} refused, {c.gone} "
                    f"clients gone before their answer, {c.in_flight} unanswered")
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


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
    source.add_argument("--exported", help="a directory written by python -m train export")
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
    """The export --exported names, or --workdir's run exported into `scratch` for this platform."""
    from train.serving.artifact import Artifact

    directory = Path(args.exported) if args.exported else scratch / "exported"
    if args.workdir:
        from train import export

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

        async def warm() -> None:
            shapes = batcher.shapes()
            say(f"compiling {len(shapes)} shapes ({len(batcher.batch_sizes)} batch sizes x lengths "
                f"{','.join(map(str, batcher.lengths))}) ...")
            seconds = await asyncio.get_running_loop().run_in_executor(None, batcher.warm, say)
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
