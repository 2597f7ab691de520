"""The JSON HTTP layer of `python -m train serve` (train/serving/server.py) around any Engine: the API's
endpoints, the checks every request passes before anything is queued, and the request counters.

The HTTP layer is aiohttp: one asyncio library that brings the server and the client the load bench and the
tests use, with the body-size limit (client_max_size) and a runner whose listening socket can be closed
while requests in flight finish, which the drain needs. Requests are checked before anything is queued: a
body over --max-body-bytes, bad JSON, a missing or empty "texts" list, a text that is not a string or not
valid Unicode, more than --max-texts texts or more than --max-chars characters in one, a text that is
empty or only whitespace or has no tokens, an unknown path or method: each is a 4xx with a one-line JSON
body {"error": "..."}. A full queue is a 503 with Retry-After. Nothing a client sends reaches the model
unchecked; an unexpected failure is a 500 with one line, and the server goes on.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from train.serving.batcher import ClosedError, QueueFullError

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
        if not text.strip():  # the byte and BPE tokenizers give tokens for spaces: a confident answer to nothing
            raise RequestError(400, f"texts[{i}] is empty or only whitespace: send texts to read")
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
