"""Serving an export: `artifact.py` loads one (jax, numpy and tokenizers only), `batcher.py` batches
concurrent requests into compiled shapes, `server.py` is the JSON HTTP layer (`python -m train serve`)."""
