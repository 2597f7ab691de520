"""The server under load and under faults, on loopback only, bounded in count and time.

    python -m bench.serve_load load --exported runs/sentiment_pretrained/exported --hf runs/sentiment_pretrained/hf \
        --workdir runs/sentiment_pretrained [--clients 1,4,16,64] [--seconds 15] [--rounds 2]
    python -m bench.serve_load faults --exported runs/sentiment/exported --workdir runs/sentiment

`load` starts each server variant as its own process on 127.0.0.1 (a free port): `python -m train serve`
with dynamic batching, the same without (`--batching off`), and, with --hf, a transformers + PyTorch
pipeline behind the same HTTP layer (bench/serve_peer.py). For each number of clients, in rounds that
interleave the variants (a drifting machine load falls on all of them alike), N clients each send one test
sentence of the run's split per request (POST /predict) and wait for the answer, for --seconds after one
second of warm-up. It reports throughput (answers per second), p50 and p99 latency and errors (any
answer other than 200, or a connection error), medians over the rounds, with the CPU model and the load
average. Every request goes to 127.0.0.1; each level ends by time and by a request cap.

`faults` runs one dynamic server through: clients that disconnect mid-request (partial headers, partial
body, a full request then gone, garbage bytes); a hypothesis fuzz of malformed requests (every answer
must be a 4xx or 200 with one line of JSON, never a 5xx or a dropped connection); and a SIGTERM under load
(every request the server accepted must be answered, 200 or an explicit 503; the server's own counts,
printed as it exits, are compared with what the clients received).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
MAX_REQUESTS_PER_LEVEL = 50_000
START_TIMEOUT_S = 900


# --- servers ------------------------------------------------------------------------------------


class Server:
    """A server process on loopback; `url` once it printed its "serving ... on URL" line."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, *argv, "--host", HOST, "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("serving"):
            self.proc.kill()
            raise RuntimeError(f"{name} did not start: {line}{self.proc.stderr.read() if self.proc.stderr else ''}")
        self.url = line.split(" on ", 1)[1].split(": POST", 1)[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self, timeout: float = 120, *, signalled: bool = False) -> tuple[int, str]:
        """SIGTERM (unless `signalled`: it was sent already), then its exit code and stderr."""
        if self.proc.poll() is None and not signalled:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def _serve_argv(exported: Path, extra: list[str]) -> list[str]:
    return ["-m", "train", "serve", "--exported", str(exported), *extra]


# --- the load -----------------------------------------------------------------------------------


async def _level(url: str, texts: list[str], clients: int, seconds: float, warmup: float = 1.0) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    counter = 0
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    done = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal counter, errors, done
        while time.perf_counter() < stop_at and done < MAX_REQUESTS_PER_LEVEL:
            text = texts[counter % len(texts)]
            counter += 1
            sent = time.perf_counter()
            try:
                async with session.post(f"{url}/predict", json={"texts": [text]}) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, OSError):
                ok = False
            finished = time.perf_counter()
            if measure_from <= finished <= stop_at:  # an answer in the window counts, whenever it was sent
                done += 1
                if ok:
                    latencies.append(finished - sent)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3 if latencies else float("nan")

    return {"clients": clients, "requests": done, "throughput": len(latencies) / seconds, "p50_ms": pct(0.5),
            "p99_ms": pct(0.99), "errors": errors}


def load_table(exported: Path, hf: Path | None, texts: list[str], *, clients: list[int], seconds: float,
               rounds: int = 1, server_args: list[str] | None = None,
               torch_threads: list[int] | None = None) -> list[dict[str, Any]]:
    """One row per (variant, clients): medians over `rounds` interleaved rounds. The transformers peer runs
    once per entry of `torch_threads` (default: torch's own thread count)."""
    extra = list(server_args or [])
    variants = {"dynamic": _serve_argv(exported, extra), "no batching": _serve_argv(exported, [*extra, "--batching",
                                                                                                  "off"])}
    if hf is not None:
        for threads in torch_threads or [0]:
            name = f"transformers ({threads} thread{'s' if threads > 1 else ''})" if threads else "transformers"
            variants[name] = ["-m", "bench.serve_peer", "--hf", str(hf),
                              *(["--torch-threads", str(threads)] if threads else [])]
    servers = {name: Server(name, argv) for name, argv in variants.items()}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for _ in range(rounds):
            for n in clients:
                for name, server in servers.items():
                    runs.setdefault((name, n), []).append(asyncio.run(_level(server.url, texts, n, seconds)))
    finally:
        codes = {name: server.stop()[0] for name, server in servers.items()}
    rows = []
    for (name, n), measured in runs.items():
        row: dict[str, Any] = {"variant": name, "clients": n, "rounds": len(measured), "exit_code": codes[name]}
        for key in ("throughput", "p50_ms", "p99_ms"):
            row[key] = statistics.median(m[key] for m in measured)
        row["errors"] = sum(m["errors"] for m in measured)
        row["requests"] = sum(m["requests"] for m in measured)
        rows.append(row)
    return rows


# --- the faults ---------------------------------------------------------------------------------


def _raw(port: int, data: bytes, *, read: bool, close_after: float = 0.0) -> bytes:
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(data)
        if close_after:
            time.sleep(close_after)
        if not read:
            return b""
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def _disconnects(port: int, count: int, text: str) -> dict[str, Any]:
    """Clients that leave mid-request, in four ways, `count` in all, while normal requests run too."""
    import http.client

    body = json.dumps({"texts": [text] * 8}).encode()
    head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    kinds = {
        "partial headers": lambda: _raw(port, head.encode()[:30], read=False),
        "partial body": lambda: _raw(port, (head + "\r\n").encode() + body[: len(body) // 2], read=False),
        "gone before the answer": lambda: _raw(port, (head + "\r\n").encode() + body, read=False),
        "garbage bytes": lambda: _raw(port, os.urandom(64) + b"\r\n\r\n", read=True),
    }
    import concurrent.futures

    statuses: list[int] = []

    def normal() -> None:
        c = http.client.HTTPConnection(HOST, port, timeout=60)
        c.request("POST", "/predict", json.dumps({"texts": [text]}))
        statuses.append(c.getresponse().status)
        c.close()

    done = {k: 0 for k in kinds}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = []
        for i in range(count):
            kind = list(kinds)[i % len(kinds)]
            futures.append((kind, pool.submit(kinds[kind])))
            futures.append(("normal", pool.submit(normal)))
        for kind, future in futures:
            with contextlib.suppress(OSError):
                future.result(timeout=120)
                if kind in done:
                    done[kind] += 1
    time.sleep(0.5)
    c = http.client.HTTPConnection(HOST, port, timeout=60)
    c.request("POST", "/predict", json.dumps({"texts": [text]}))
    after = c.getresponse().status == 200
    c.close()
    c = http.client.HTTPConnection(HOST, port, timeout=60)
    c.request("GET", "/health")
    health = json.loads(c.getresponse().read())
    c.close()
    return {"clients": done, "normal_requests": len(statuses), "normal_200": statuses.count(200),
            "server_alive": health["status"] == "ok", "answered_after": after, "server_counts": health["requests"]}


def _fuzz(port: int, examples: int) -> dict[str, Any]:
    """Hypothesis-generated requests: every answer must be a 2xx/4xx with one line of JSON."""
    import http.client

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
    values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                                             max_size=6), max_leaves=30)
    bodies = (st.binary(max_size=500) | values.map(lambda v: json.dumps(v).encode())
              | st.lists(st.text(max_size=80) | values, max_size=8).map(lambda t: json.dumps({"texts": t}).encode())
              | st.lists(st.text(max_size=400), min_size=1, max_size=80).map(
                  lambda t: json.dumps({"texts": t}).encode()))
    counts = {"requests": 0, "2xx": 0, "4xx": 0, "5xx": 0, "not_json": 0, "connection_errors": 0}
    by_status: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH"]),
           path=st.sampled_from(["/predict"] * 4 + ["/embed"] * 2 + ["/health", "/", "/predict/../x", "/%ff"]),
           body=bodies,
           content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
    def one(method: str, path: str, body: bytes, content_type: str) -> None:
        counts["requests"] += 1
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        try:
            conn.request(method, path, body=None if method == "GET" else body,
                         headers={"Content-Type": content_type} if content_type else {})
            response = conn.getresponse()
            raw = response.read()
        except OSError:
            counts["connection_errors"] += 1
            return
        finally:
            conn.close()
        by_status[response.status] = by_status.get(response.status, 0) + 1
        counts[f"{response.status // 100}xx"] = counts.get(f"{response.status // 100}xx", 0) + 1
        try:
            json.loads(raw)
            one_line = raw.count(b"\n") == 1 and raw.endswith(b"\n")
        except ValueError:
            one_line = False
        if not one_line:
            counts["not_json"] += 1

    one()
    return {**counts, "by_status": {str(k): v for k, v in sorted(by_status.items())}}


async def _sigterm_under_load(server: Server, texts: list[str], clients: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    received: dict[str, int] = {}
    lost = 0  # a request sent on an open connection that got no answer

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal lost
        k = i
        while True:
            k += clients
            try:
                async with session.post(f"{server.url}/predict", json={"texts": [texts[k % len(texts)]]}) as response:
                    await response.read()
                    received[str(response.status)] = received.get(str(response.status), 0) + 1
            except aiohttp.ClientConnectorError:  # refused: the listener is closed, nothing was accepted
                received["refused"] = received.get("refused", 0) + 1
                return
            except (aiohttp.ClientError, OSError) as err:
                # The server closed a kept-alive connection as it drained: the request never reached a handler
                # (the server's own count below says whether any accepted request went unanswered).
                name = type(err).__name__
                received[name] = received.get(name, 0) + 1
                await asyncio.sleep(0.01)

    async def terminate() -> None:
        await asyncio.sleep(seconds)
        server.proc.send_signal(signal.SIGTERM)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.wait_for(asyncio.gather(terminate(), *(client(session, i) for i in range(clients))), 300)
    code, err = server.stop(signalled=True)
    stopped = next((ln for ln in err.splitlines() if ln.startswith("stopped:")), "")
    numbers = [int(w) for w in stopped.replace(",", "").split() if w.isdigit()]
    accepted, answered, refused, gone, unanswered = (numbers + [-1] * 5)[:5]
    responses = sum(v for k, v in received.items() if k.isdigit())
    return {"exit_code": code, "clients": clients, "client_received": received, "server_line": stopped,
            "server_accepted": accepted, "server_answered": answered, "server_refused": refused, "server_gone": gone,
            "server_unanswered": unanswered, "lost": accepted - responses, "lost_definition":
            "requests the server accepted minus answers the clients received (must be 0)"}


def fault_run(exported: Path, texts: list[str], *, server_args: list[str] | None = None, fuzz_examples: int = 500,
              disconnects: int = 100, clients: int = 32, seconds: float = 10.0) -> dict[str, Any]:
    extra = list(server_args or [])
    server = Server("dynamic", _serve_argv(exported, extra))
    try:
        out = {"disconnects": _disconnects(server.port, disconnects, texts[0]),
               "fuzz": _fuzz(server.port, fuzz_examples)}
    finally:
        code, _ = server.stop()
    out["first_server_exit_code"] = code
    server = Server("dynamic", _serve_argv(exported, extra))
    out["sigterm"] = asyncio.run(_sigterm_under_load(server, texts, clients, seconds))
    return out


# --- the command --------------------------------------------------------------------------------


def test_texts(workdir: Path) -> list[str]:
    """The test split's sentences of the run in `workdir` (its own data settings)."""
    from train.checkpoints.store import TOKENIZER_DIR, read_run_config
    from train.tasks import task_for

    config = read_run_config(workdir)
    data = task_for(config).load_data(config, tokenizer_dir=workdir / TOKENIZER_DIR)
    return list(data.test.texts)


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "load_average": os.getloadavg()}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| clients | variant | throughput (req/s) | p50 (ms) | p99 (ms) | errors |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["clients"], r["variant"])):
        lines.append(f"| {r['clients']} | {r['variant']} | {r['throughput']:.1f} | {r['p50_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {r['errors']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["load", "faults"])
    p.add_argument("--exported", required=True, help="an export (python -m train export)")
    p.add_argument("--workdir", required=True, help="the run: its test split's sentences are the requests")
    p.add_argument("--hf", help="load: its --format hf export, served by the transformers pipeline peer")
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--torch-threads", default="1,2", help="the peer's torch threads, one variant each (0: torch's "
                   "default)")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    texts = test_texts(Path(args.workdir))
    info = machine()
    print(f"CPU: {info['cpu']} ({info['cores']} cores), load average {info['load_average']}", flush=True)
    if args.what == "load":
        clients = [int(c) for c in args.clients.split(",")]
        rows = load_table(Path(args.exported), Path(args.hf) if args.hf else None, texts, clients=clients,
                          seconds=args.seconds, rounds=args.rounds,
                          torch_threads=[int(t) for t in args.torch_threads.split(",")])
        print(_table(rows))
        result: Any = {"machine": info, "load_after": os.getloadavg(), "rows": rows}
    else:
        result = {"machine": info, **fault_run(Path(args.exported), texts)}
        print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
