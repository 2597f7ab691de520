"""The load bench's peer: a transformers + PyTorch text-classification pipeline behind our HTTP layer.

    python -m bench.serve_peer --hf HF_DIR [--port P]     # HF_DIR: python -m train export --format hf

The same aiohttp service as `python -m train serve` (train/serving/service.py: the same JSON API, limits,
queue bound and drain), with `transformers.pipeline("text-classification")` answering each request as it
comes, as a pipeline is usually deployed: one request is one pipeline call (its texts as one batch, padded
to the longest, truncated to the model's max length), one call at a time. Only /predict is served.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
from typing import Any

from train.serving.batcher import QueueFullError
from train.serving.server import run_server
from train.serving.service import Limits


class PipelineEngine:
    def __init__(self, directory: str, max_queue: int = 512, threads: int | None = None):
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)

        self.pipe = transformers.pipeline("text-classification", model=directory, tokenizer=directory, top_k=None,
                                          device="cpu")
        config = self.pipe.model.config
        self.labels = [config.id2label[i] for i in range(config.num_labels)]
        self.max_len = int(self.pipe.tokenizer.model_max_length)
        self.max_queue, self.queued = max_queue, 0
        self.directory = directory
        self.threads = torch.get_num_threads()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline")

    def describe(self) -> dict[str, Any]:
        return {"kind": "classifier", "labels": self.labels, "max_len": self.max_len, "outputs": ["probabilities"],
                "batching": "off (transformers pipeline)", "queued_rows": self.queued,
                "torch_threads": self.threads}

    def offers(self, endpoint: str) -> str | None:
        return None if endpoint == "/predict" else "the transformers pipeline peer serves POST /predict only"

    def _run(self, texts: list[str]) -> list[list[dict[str, Any]]]:
        return list(self.pipe(texts, batch_size=len(texts), truncation=True, max_length=self.max_len))

    async def answer(self, endpoint: str, texts: list[str]) -> dict[str, Any]:
        if self.queued + len(texts) > self.max_queue:
            raise QueueFullError
        self.queued += len(texts)
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, texts)
        finally:
            self.queued -= len(texts)
        predictions = []
        for scores in results:
            probs = {s["label"]: float(s["score"]) for s in scores}
            best = max(probs, key=lambda k: probs[k])
            predictions.append({"label": best, "probability": probs[best],
                                "probabilities": {name: probs[name] for name in self.labels}, "truncated": None})
        return {"predictions": predictions}

    async def drain(self) -> None:
        self._executor.shutdown(wait=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_peer", description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="a transformers directory (python -m train export --format hf)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--max-queue", type=int, default=512)
    p.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's, one per core)")
    args = p.parse_args(argv)
    engine = PipelineEngine(args.hf, args.max_queue, args.torch_threads)

    def ready(url: str) -> None:
        print(f"serving a transformers pipeline ({', '.join(engine.labels)}) from {args.hf} on {url}: POST /predict "
              f"(torch threads {engine.threads})", flush=True)

    return asyncio.run(run_server(engine, host=args.host, port=args.port, limits=Limits(), on_ready=ready))


if __name__ == "__main__":
    sys.exit(main())
