"""An export of `python -m train export` loaded for serving, no model code: jax, flatbuffers, numpy, tokenizers.

    artifact = Artifact.load("runs/sentiment/exported")   # checksums checked: a damaged file is refused
    rows, truncated = artifact.encode(["a gripping film"])   # token ids per text, truncated to max_len
    outputs = artifact.run(tokens, mask)                      # {"probabilities": [b, C], ...} as numpy

Every file the manifest lists is read and checked against its SHA-256 before anything is deserialized;
a mismatch, a missing file or an unknown format is a CheckpointError (one line, exit 2). An export is a
program (jax.export deserializes StableHLO): serve only exports you trust.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.errors import CheckpointError

FORMAT = "jaxblock-export/1"
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.jax"


@dataclass
class Artifact:
    directory: Path
    manifest: dict[str, Any]
    model: Any  # jax.export.Exported
    params: list[jax.Array] | None  # on the device; None when they are inside model.jax
    tokenizer: Any  # tokenizers.Tokenizer, truncating to max_len, not padding

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def labels(self) -> list[str]:
        return list(self.manifest.get("labels") or [])

    @property
    def max_len(self) -> int:
        return int(self.manifest["max_len"])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["tokenizer"]["pad_id"])

    @property
    def outputs(self) -> list[str]:
        return list(self.manifest["outputs"])

    @classmethod
    def load(cls, directory: str | Path) -> Artifact:
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / MANIFEST_FILE
        fix = f"export the run again (python -m train export --out {directory})"
        if not path.is_file():
            raise CheckpointError(f"{directory} holds no export ({MANIFEST_FILE} missing): pass a directory written "
                                  "by python -m train export")
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            files = dict(manifest["files"])
            needed = {MODEL_FILE, manifest["params"]["in"], manifest["tokenizer"]["file"]}
            if manifest.get("format") != FORMAT:
                raise CheckpointError(f"{directory} is an export of format {manifest.get('format')!r}, not {FORMAT}: "
                                      f"{fix}")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{path} is damaged ({err.__class__.__name__}): {fix}") from None
        missing = sorted(needed - set(files))
        if missing:
            raise CheckpointError(f"export {directory} is damaged: its manifest lists no {missing[0]}: {fix}")
        data: dict[str, bytes] = {}
        for name, entry in files.items():
            try:
                data[name] = (directory / name).read_bytes()
            except OSError as err:
                raise CheckpointError(f"export {directory} is damaged: {name} is unreadable ({err.strerror}): {fix}"
                                      ) from None
            if hashlib.sha256(data[name]).hexdigest() != entry.get("sha256"):
                raise CheckpointError(f"export {directory} is damaged: {name} fails its SHA-256 check: {fix}")
        try:
            model = jax.export.deserialize(bytearray(data[MODEL_FILE]))
            tokenizer = Tokenizer.from_str(data[manifest["tokenizer"]["file"]].decode("utf-8"))
        except Exception as err:  # checksums matched, so the writer or this jax cannot read it
            raise CheckpointError(f"export {directory} cannot be loaded by jax {jax.__version__} "
                                  f"({err.__class__.__name__}; written by jax {manifest.get('jax_version')}): {fix}"
                                  ) from None
        tokenizer.no_padding()
        params = None
        if manifest["params"]["in"] != MODEL_FILE:
            raw = data[manifest["params"]["in"]]
            params = jax.device_put([np.frombuffer(raw, jax.numpy.dtype(dtype), count, offset).reshape(shape)
                                     for dtype, shape, offset, count in manifest["params"]["layout"]])
        return cls(directory, manifest, model, params, tokenizer)

    def encode(self, texts: list[str]) -> tuple[list[np.ndarray], list[bool]]:
        """Token ids per text (truncated to max_len, as the run's own tokenizer path) and whether each was."""
        encodings = self.tokenizer.encode_batch(texts)
        return ([np.asarray(e.ids, np.int32) for e in encodings], [bool(e.overflowing) for e in encodings])

    def run(self, tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The exported function on int32 [b, l] tokens and mask, outputs as numpy (ValueError outside the
        export's contract: b >= 1, 1 <= l <= max_len, equal shapes)."""
        if tokens.shape != mask.shape or tokens.ndim != 2 or min(tokens.shape) < 1 or tokens.shape[1] > self.max_len:
            raise ValueError(f"tokens {tokens.shape} and mask {mask.shape}: the export takes [b, l] with b >= 1 and "
                             f"1 <= l <= {self.max_len}")
        args = (tokens, mask) if self.params is None else (self.params, tokens, mask)
        return {k: np.asarray(v) for k, v in self._call(*args).items()}

    @functools.cached_property
    def _call(self) -> Any:
        # Exported.call flattens and checks its arguments on every call (~0.7 ms for the main job's export,
        # ~6 ms for MiniLM's 100 parameter arrays); under jit that happens once per shape.
        return jax.jit(self.model.call)
