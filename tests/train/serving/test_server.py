"""`python -m train serve`: dynamic batching into compiled shapes with a bounded queue, a JSON API that refuses
every bad request in one line (property-tested), and a SIGTERM that answers every accepted request.

The batcher and the HTTP layer are tested here with a model that is plain numpy (no compile); one test runs
the real command on the shared tiny run. The load bench and the fault run against a real export are in
bench/serve_load.py, under `slow` below."""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import free_port
from train.serving.batcher import Batcher, ClosedError, QueueFullError
from train.serving.server import ArtifactEngine
from train.serving.service import Limits, Service

LENGTHS = [4, 8]
SIZES = [1, 2, 4]


class FakeArtifact:
    """What ArtifactEngine reads of an export: a whitespace tokenizer (one id per word, up to 8; a text of
    spaces gives one id per space, as the byte and BPE tokenizers give tokens for it) and a model whose
    'probabilities' are a function of each row's ids, so a row's answer shows which row it was."""

    kind, labels, max_len, outputs = "classifier", ["no", "yes"], 8, ["embeddings", "logits", "probabilities"]
    directory = Path("fake")

    def __init__(self, delay: float = 0.0):
        self.manifest: dict[str, Any] = {}
        self.delay = delay
        self.shapes: list[tuple[int, int]] = []

    def encode(self, texts: list[str]) -> tuple[list[np.ndarray], list[bool]]:
        rows = [np.asarray(([min(len(w), 9) for w in t.split()] or [1] * len(t))[:8], np.int32) for t in texts]
        return rows, [len(t.split()) > 8 for t in texts]

    def run(self, tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        self.shapes.append(tokens.shape)
        time.sleep(self.delay)
        total = (tokens * mask).sum(1).astype(np.float32)
        p = 1.0 / (1.0 + np.exp(-(total - 5.0)))
        return {"probabilities": np.stack([1 - p, p], 1), "logits": np.stack([-total, total], 1),
                "embeddings": np.stack([total, mask.sum(1).astype(np.float32)], 1)}


def _expected(text: str) -> float:
    total = sum(min(len(w), 9) for w in text.split()[:8])
    return float(1.0 / (1.0 + np.exp(-(total - 5.0))))


def _batcher(artifact: FakeArtifact, **kw: Any) -> Batcher:
    return Batcher(artifact.run, pad_id=0, lengths=LENGTHS, batch_sizes=SIZES, max_queue=kw.pop("max_queue", 64),
                   **kw)


# --- the batcher --------------------------------------------------------------------------------


def test_concurrent_requests_share_batches_of_compiled_shapes_and_get_their_own_rows():
    artifact = FakeArtifact(delay=0.05)
    texts = [" ".join(["ab"] * (1 + i % 7)) for i in range(12)]

    async def go() -> list[Any]:
        batcher = _batcher(artifact)
        batcher.start()
        engine = ArtifactEngine(artifact, batcher)
        answers = await asyncio.gather(*(engine.answer("/predict", [t]) for t in texts))
        await batcher.drain()
        return [answers, batcher.stats()]

    answers, stats = asyncio.run(go())
    for text, answer in zip(texts, answers, strict=True):
        assert answer["predictions"][0]["probability"] == pytest.approx(max(_expected(text), 1 - _expected(text)))
    assert set(artifact.shapes) <= {(b, n) for b in SIZES for n in LENGTHS}
    assert stats["batches"] < len(texts) and stats["rows"] == len(texts) and stats["queued_rows"] == 0
    assert max(b for b, _ in artifact.shapes) == 4  # rows of several requests in one run


def test_without_dynamic_batching_each_request_runs_alone():
    artifact = FakeArtifact(delay=0.01)

    async def go() -> None:
        batcher = _batcher(artifact, dynamic=False)
        batcher.start()
        engine = ArtifactEngine(artifact, batcher)
        await asyncio.gather(*(engine.answer("/predict", ["ab cd", "x"]) for _ in range(5)))
        await batcher.drain()

    asyncio.run(go())
    assert artifact.shapes == [(2, 4)] * 5


@pytest.mark.parametrize("overhead,big,want", [
    (0.0, 1.0, [[6, 2, 3, 7], [1, 2], [5, 8]]),  # cost proportional to size x length: short rows stay short
    (1.0, 1.0, [[6, 2, 3, 7], [1, 5, 8, 2]]),  # a large cost per run: the fuller batch at the longer length
    (0.0, 3.0, [[6, 2], [3, 1], [7, 5], [8, 2]]),  # batches of 4 dearer per row than of 2: pairs, short ones short
])
def test_each_batch_holds_the_oldest_row_and_costs_least_per_row(overhead, big, want):
    artifact = FakeArtifact()
    batcher = _batcher(artifact)
    batcher.costs = {(b, n): (overhead + b * n * 1e-3) * (big if b == 4 else 1.0) for b in SIZES for n in LENGTHS}

    async def go() -> list[list[int]]:
        rows = [np.ones(n, np.int32) for n in (6, 2, 3, 7, 1, 5, 8, 2)]  # buckets 8, 4, 4, 8, 4, 8, 8, 4
        futures = [asyncio.ensure_future(batcher.submit([r])) for r in rows]
        await asyncio.sleep(0)
        batches = []
        while batch := batcher._next_batch():
            batches.append([len(job.rows[i]) for job, i in batch])
        for f in futures:
            f.cancel()
        return batches

    assert asyncio.run(go()) == want


def test_a_full_queue_refuses_at_once_and_a_drain_answers_what_it_accepted():
    artifact = FakeArtifact(delay=0.05)

    async def go() -> tuple[list[Any], list[Any]]:
        batcher = _batcher(artifact, max_queue=6)
        batcher.start()
        rows = [np.ones(3, np.int32)] * 4
        first = [asyncio.ensure_future(batcher.submit(rows[:2])) for _ in range(3)]  # 6 rows: the queue is full
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await batcher.submit(rows[:1])
        drained = asyncio.ensure_future(batcher.drain())
        await asyncio.sleep(0)
        with pytest.raises(ClosedError):
            await batcher.submit(rows[:1])
        await drained
        return [f.result() for f in first], artifact.shapes

    results, shapes = asyncio.run(go())
    assert all(len(r) == 2 for r in results) and sum(b for b, _ in shapes) >= 6


def test_a_warm_up_told_to_stop_runs_no_shape_it_had_not_begun():
    artifact = FakeArtifact()
    stop = threading.Event()
    run = artifact.run

    def first_then_stop(tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        stop.set()  # as a signal during the first compile would
        return run(tokens, mask)

    artifact.run = first_then_stop  # type: ignore[method-assign]
    batcher = _batcher(artifact)
    batcher.warm(threads=1, stop=stop)
    assert len(artifact.shapes) == 1 and batcher.costs == {}  # of 6 shapes to compile, then 12 timed runs


# --- the HTTP layer -----------------------------------------------------------------------------


class Served:
    """A Service on a real loopback port, its loop in a thread, for plain blocking clients."""

    def __init__(self, engine: Any, limits: Limits):
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.service: Service | None = None
        ready = threading.Event()

        async def start() -> None:
            self.service = Service(engine, limits, say=lambda line: None)
            self.runner = web.AppRunner(self.service.app(), access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = self.runner.addresses[0][1]
            engine.batcher.start()
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert ready.wait(30)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served():
    artifact = FakeArtifact()
    server = Served(ArtifactEngine(artifact, _batcher(artifact)), Limits(max_texts=4, max_chars=50,
                                                                         max_body_bytes=2000))
    yield server
    server.close()


def _post(served: Served, path: str, payload: Any) -> tuple[int, Any]:
    status, body = served.request("POST", path, json.dumps(payload).encode())
    assert body.endswith(b"\n") and body.count(b"\n") == 1, body
    return status, json.loads(body)


def test_predict_embed_and_health_answer_in_json(served):
    status, body = _post(served, "/predict", {"texts": ["ab cd ef", "a"]})
    assert status == 200 and [p["label"] for p in body["predictions"]] == ["yes", "no"]
    assert body["predictions"][0]["probabilities"]["yes"] == pytest.approx(_expected("ab cd ef"))
    status, body = _post(served, "/embed", {"texts": ["ab cd"]})
    assert status == 200 and body["embeddings"] == [[4.0, 2.0]] and body["truncated"] == [False]
    status, raw = served.request("GET", "/health")
    health = json.loads(raw)
    assert status == 200 and health["status"] == "ok" and health["kind"] == "classifier"
    assert health["requests"]["answered"] >= 2 and health["batching"] == "dynamic"


@pytest.mark.parametrize("request_,status,words", [
    (("POST", "/predict", b"{not json"), 400, "not JSON"),
    (("POST", "/predict", b'{"text": "a"}'), 400, 'no "texts"'),
    (("POST", "/predict", b'{"texts": []}'), 400, "non-empty list"),
    (("POST", "/predict", b'{"texts": "a"}'), 400, "non-empty list"),
    (("POST", "/predict", b'{"texts": ["a", 3]}'), 400, "texts[1] is a int"),
    (("POST", "/predict", b'{"texts": ["a", "b", "c", "d", "e"]}'), 413, "over the limit of 4"),
    (("POST", "/predict", json.dumps({"texts": ["x" * 51]}).encode()), 413, "51 characters"),
    (("POST", "/predict", b'{"texts": ["a", "   "]}'), 400, "texts[1] is empty or only whitespace"),
    (("POST", "/embed", b'{"texts": ["\\t\\n "]}'), 400, "texts[0] is empty or only whitespace"),
    (("POST", "/predict", b'{"texts": [""]}'), 400, "texts[0] is empty or only whitespace"),
    (("POST", "/predict", b'{"texts": ["\\ud800"]}'), 400, "lone surrogate"),
    (("POST", "/predict", b"[" * 5000 + b"]" * 5000), 413, "over the limit"),
    (("POST", "/predict", b'{"texts": ["' + b"a " * 1200 + b'"]}'), 413, "over the limit of 2000 bytes"),
    (("GET", "/predict", None), 405, "GET is not allowed"),
    (("POST", "/nowhere", b"{}"), 404, "no endpoint /nowhere"),
])
def test_each_bad_request_gets_a_4xx_with_one_line_of_json(served, request_, status, words):
    got, body = served.request(*request_)
    assert got == status, body
    assert body.endswith(b"\n") and body.count(b"\n") == 1
    assert words in json.loads(body)["error"]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)
_BODIES = (st.binary(max_size=300) | _JSON.map(lambda v: json.dumps(v).encode())
           | st.lists(st.text(max_size=60) | _JSON, max_size=6).map(lambda t: json.dumps({"texts": t}).encode())
           | st.lists(st.text(max_size=60), min_size=1, max_size=6).map(lambda t: json.dumps({"texts": t}).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
       path=st.sampled_from(["/predict", "/embed", "/health", "/", "/predict/x"]), body=_BODIES,
       content_type=st.sampled_from(["application/json", "text/plain", "", "multipart/form-data; boundary=x"]))
def test_fuzzed_requests_are_answered_in_json_and_never_break_the_server(served, method, path, body, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    status, raw = served.request(method, path, body if method != "GET" else None, headers)
    assert status < 500, raw
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1, raw
    answer = json.loads(raw)
    if status == 200 and path in ("/predict", "/embed"):
        texts = json.loads(body)["texts"]
        assert len(answer["predictions" if path == "/predict" else "embeddings"]) == len(texts)
    elif status >= 400:
        assert set(answer) == {"error"}


# --- the command, end to end --------------------------------------------------------------------


def _start_server(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "train", "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT: ..." once warmed
    if not line.startswith("serving"):
        proc.kill()
        pytest.fail(f"the server did not start: {line}{proc.stderr.read() if proc.stderr else ''}")
    url = line.split(" on ", 1)[1].split(": POST", 1)[0]
    return proc, url


def _serve_fake(monkeypatch, artifact: FakeArtifact, port: int, capsys) -> tuple[int, list[str], str]:
    """`python -m train serve --port PORT` in this process, serving `artifact`: exit code, stderr lines, stdout."""
    from train.__main__ import main
    from train.serving import server

    monkeypatch.setattr(server, "load_engine", lambda args, scratch: ArtifactEngine(artifact, _batcher(artifact)))
    capsys.readouterr()
    code = main(["serve", "--exported", "fake", "--port", str(port)])
    captured = capsys.readouterr()
    return code, captured.err.splitlines(), captured.out


def test_a_busy_port_is_one_line_exit_2_before_any_shape_is_compiled(monkeypatch, capsys):
    artifact = FakeArtifact()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err, out = _serve_fake(monkeypatch, artifact, port, capsys)
    assert code == 2 and out == ""
    assert err == [f"error: cannot listen on 127.0.0.1:{port} (Address already in use): pass another --port or --host"]
    assert artifact.shapes == []


def test_during_the_warm_up_the_port_is_held_and_a_signal_ends_serve_as_training_ends(monkeypatch, capsys):
    """While the shapes compile, the port is bound (no other process can take it) but refuses connections
    (nothing would answer them); SIGTERM then stops the warm-up with the line and exit code training gives
    when interrupted during start-up, and nothing of the drain (no "draining", no "stopped:")."""
    port = free_port()
    artifact = FakeArtifact()
    seen: list[str] = []
    first = threading.Lock()  # the warm-up compiles on several threads: only the first call checks
    run = artifact.run

    def first_shape(tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        if first.acquire(blocking=False):
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port))
                    seen.append("bound by another")
                except OSError as err:
                    seen.append(errno.errorcode[err.errno])
            with socket.socket() as client:
                seen.append(errno.errorcode[client.connect_ex(("127.0.0.1", port))])
            os.kill(os.getpid(), signal.SIGTERM)
        return run(tokens, mask)

    artifact.run = first_shape  # type: ignore[method-assign]
    code, err, out = _serve_fake(monkeypatch, artifact, port, capsys)
    assert seen == ["EADDRINUSE", "ECONNREFUSED"]
    assert code == 130 and out == "", err
    assert err[-1] == ("interrupted during start-up: stopped; checkpoints already saved in the workdir are intact "
                       "(rerun the same command to continue)")
    assert not any(line.startswith(("compiled in", "SIGTERM", "stopped:")) for line in err), err


def test_a_signal_in_the_warm_ups_last_moment_still_ends_it_as_an_interrupted_start_up():
    """The signal and the end of the last compile reach the event loop in one turn (the loop was busy while
    both happened): the warm-up still counts as interrupted, and nothing is served or drained. Before the
    server yielded once after the warm-up, it went on to serve and the signal then drained it (exit 0)."""
    from train.interrupts import Interrupted
    from train.serving.server import run_server

    artifact = FakeArtifact()
    said: list[str] = []
    halted: list[bool] = []

    async def warm(stop: threading.Event) -> None:
        ended = threading.Event()

        def last_compile() -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            ended.set()

        job = asyncio.get_running_loop().run_in_executor(None, last_compile)
        ended.wait(10)  # the loop held, as by a busy turn, until the signal is sent and the job returns
        await job
        halted.append(stop.is_set())

    async def serve() -> int:
        return await run_server(ArtifactEngine(artifact, _batcher(artifact)), host="127.0.0.1", port=free_port(),
                                limits=Limits(), warm=warm, say=said.append)

    with pytest.raises(Interrupted):
        asyncio.run(serve())
    assert halted == [False]  # the handler had not run when the warm-up returned: the case this test is for
    assert not any(line.startswith(("SIGTERM", "stopped:")) for line in said), said


def test_exported_may_name_the_workdir_that_holds_the_export(monkeypatch, tmp_path, capsys):
    """`serve --exported runs/sentiment` serves runs/sentiment/exported, where `export --workdir` writes."""
    from train.__main__ import main
    from train.errors import CheckpointError
    from train.serving.artifact import Artifact

    loaded: list[Path] = []

    def load(cls, directory):
        loaded.append(Path(directory))
        raise CheckpointError("loaded")  # what happens next is another test's

    monkeypatch.setattr(Artifact, "load", classmethod(load))
    (tmp_path / "exported").mkdir()
    (tmp_path / "exported/manifest.json").write_text("{}")
    for directory in (tmp_path, tmp_path / "exported"):
        assert main(["serve", "--exported", str(directory)]) == 2
    assert loaded == [tmp_path / "exported"] * 2
    (tmp_path / "exported/manifest.json").unlink()
    (tmp_path / "config.yaml").write_text("{}")  # a run's workdir, not exported
    capsys.readouterr()
    assert main(["serve", "--exported", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --exported {tmp_path} is a run's workdir with no export in it: serve "
                                       f"it with --workdir {tmp_path} (exported at start), or run python -m train "
                                       f"export --workdir {tmp_path} first\n")


@pytest.mark.slow
def test_serve_a_run_then_sigterm_answers_every_accepted_request_and_exits_0(tmp_path):
    from tests.conftest import tiny_config
    from train import run

    workdir = tmp_path / "run"
    run.train(tiny_config(), workdir)  # the reference run's config (cached programs), outside its test group
    proc, url = _start_server(["--workdir", str(workdir), "--lengths", "16", "--max-batch", "4"])
    port = int(url.rsplit(":", 1)[1])
    from train.inference import TrainedRun

    texts = ["1 2 3", "4 5 6 7 8 9", " ".join(["3"] * 30)]
    want = TrainedRun.load(workdir).predict(texts)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/predict", json.dumps({"texts": texts}))
    got = json.loads(conn.getresponse().read())["predictions"]
    assert [g["label"] for g in got] == [w.label for w in want]
    assert np.allclose([g["probability"] for g in got], [w.probability for w in want], atol=1e-5)
    assert [g["truncated"] for g in got] == [False, False, True]

    results: list[int | str] = []

    def client() -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            c.request("POST", "/predict", json.dumps({"texts": ["1 2 3"] * 4}))
            results.append(c.getresponse().status)
        except (OSError, http.client.HTTPException) as err:  # never reached a handler: the listener had closed
            results.append(type(err).__name__)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = [ln for ln in err.splitlines() if ln.startswith("stopped:")]
    assert len(stopped) == 1 and "0 unanswered" in stopped[0], err
    accepted = int(stopped[0].split()[1])
    answered = sum(1 for r in results if r in (200, 503))
    assert accepted == 1 + answered, (stopped, results)  # every request a handler took was answered
    assert 200 in results, results


@pytest.fixture(scope="module")
def tiny_export(reference_run, tmp_path_factory) -> Path:
    from train.__main__ import main

    out = tmp_path_factory.mktemp("serve") / "exported"
    assert main(["export", "--workdir", str(reference_run[0]), "--out", str(out), "--platforms", "cpu"]) == 0
    return out


@pytest.mark.slow
def test_serve_on_a_busy_port_says_so_before_compiling(tiny_export):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "train", "serve", "--exported", str(tiny_export), "--port",
                               str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"error: cannot listen on 127.0.0.1:{port} (Address already in use): pass another "
                           "--port or --host\n")


@pytest.mark.slow
def test_sigterm_during_the_warm_up_ends_serve_with_trainings_line_and_exit_130(tiny_export):
    lengths = ",".join(str(n) for n in range(1, 17))  # x 7 batch sizes: 112 shapes, the signal comes at the first
    proc = subprocess.Popen([sys.executable, "-m", "train", "serve", "--exported", str(tiny_export), "--port", "0",
                             "--lengths", lengths, "--max-batch", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("compiling 112 shapes"), first
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    lines = err.splitlines()
    assert proc.returncode == 130 and out == "", err
    assert lines[-1] == ("interrupted during start-up: stopped; checkpoints already saved in the workdir are intact "
                         "(rerun the same command to continue)")
    assert not any(line.startswith(("compiled in", "SIGTERM", "stopped:")) for line in lines), err


@pytest.mark.parametrize("argv,words", [
    (["--exported", "nowhere"], "holds no export"),
    (["--workdir", "nowhere"], "does not exist"),
    (["--exported", "x", "--max-queue", "3"], "below --max-texts"),
])
def test_bad_serve_input_is_one_line_exit_2(argv, words, capsys):
    from train.__main__ import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


# --- under load and under faults (bench/serve_load.py) ------------------------------------------


@pytest.mark.slow
def test_load_bench_and_fault_run_on_the_tiny_run(reference_run, tmp_path):
    from bench import serve_load

    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    export_dir = tmp_path / "exported"
    from train.__main__ import main

    assert main(["export", "--workdir", str(workdir), "--out", str(export_dir), "--platforms", "cpu"]) == 0
    texts = [f"{i % 16} {(i * 3) % 16} {(i * 5) % 16}" for i in range(64)]
    rows = serve_load.load_table(export_dir, None, texts, clients=[1, 8], seconds=3.0,
                                 server_args=["--lengths", "16", "--max-batch", "8"])
    assert {r["variant"] for r in rows} == {"dynamic", "no batching"}
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in rows), rows
    faults = serve_load.fault_run(export_dir, texts, server_args=["--lengths", "16", "--max-batch", "8"],
                                  fuzz_examples=100, disconnects=20, clients=8, seconds=3.0)
    assert faults["fuzz"]["5xx"] == 0 and faults["fuzz"]["not_json"] == 0
    assert faults["disconnects"]["server_alive"] and faults["disconnects"]["answered_after"]
    term = faults["sigterm"]
    assert term["exit_code"] == 0 and term["lost"] == 0 and term["server_unanswered"] == 0, term
