"""Serving an export: `artifact.py` loads one (no model code), `batcher.py` batches
concurrent requests into compiled shapes, `service.py` is the JSON HTTP layer and `server.py` the command
(`python -m train serve`)."""
