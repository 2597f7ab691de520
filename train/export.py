"""`python -m train export`: a trained run (or a pretrained checkpoint) as files that need no model code.

    python -m train export --workdir runs/sentiment                      # -> runs/sentiment/exported
    python -m train export --model hf:all-MiniLM-L6-v2 --out minilm      # sentence embeddings
    python -m train export --workdir runs/sentiment_pretrained --format hf --out hf-dir   # transformers

The default format is a `jax.export` artifact (docs/serving.md): `model.jax`, the serialized StableHLO of
the inference function with symbolic batch and length (`b >= 1`, `1 <= l <= max_len`), lowered for every
platform of --platforms (default cpu, cuda and tpu: one file for all three); `params.safetensors`, the
parameters, passed as the function's first argument (measured against constants inside model.jax: the same
size, half the compile time per shape and half the memory; `--params artifact` writes that form);
`tokenizer.json`, the run's tokenizer set to truncate to max_len and pad to the longest text; and
`manifest.json`: the versions, the calling convention, the platforms, the attention kernel and why, the
input contract, the outputs, the class labels, the parameters' order and byte layout, and a SHA-256 of every
file. Loading it needs LOADER_PACKAGES (jax.export's deserialize imports flatbuffers, which jax lacks) alone.

The function takes (params, tokens int32[b, l], attention_mask int32[b, l]) (1 = real token, real tokens
first, what `tokenizer.json`'s encode_batch gives) and returns a dict: a classifier's `logits` and
`probabilities` [b, C] and `embeddings` [b, D] (the encoder's output pooled as its head reads it, before any
pooler), an encoder's `embeddings` [b, D] (a masked-LM run: mean over real tokens; a pretrained checkpoint:
its own pooling, as `train embed`).

Attention runs XLA's plain-HLO kernel in the export whatever the run trained with: the cuDNN and Pallas
kernels are custom calls that `jax.export` cannot serialize portably, and one artifact serves every
platform, so no platform-specific kernel can be in it (see KERNEL_REASON).

`--format hf` writes a transformers directory instead (train/export_hf.py); the tokenizer.json of both
formats is train/export_tokenizer.py's.

Everything is written into a temporary directory beside --out and renamed into place at the end, so a
partial export never looks complete; an existing export at --out is replaced only then. Bad input is one
line and exit 2 (train/errors.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.errors import CheckpointError, UsageError
from train.export_tokenizer import exported_tokenizer
from train.workdir.files import replace_dir

FORMAT = "jaxblock-export/1"
MODEL_FILE = "model.jax"
PARAMS_FILE = "params.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
DEFAULT_DIR = "exported"  # --out when omitted: <workdir>/exported
LOADER_PACKAGES = ("jax", "flatbuffers", "numpy", "tokenizers")  # what loading an export needs
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what jax.export lowers for
DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")
KERNEL = "xla"
KERNEL_REASON = ("XLA's attention (jax.nn.dot_product_attention, implementation='xla') is plain StableHLO: it "
                 "serializes with jax.export's compatibility guarantee and compiles on cpu, cuda and tpu from one "
                 "lowering; cuDNN and Pallas (splash, Triton) kernels are custom calls that are platform-specific "
                 "or not serializable, and the dense CPU kernel's advantage is its hand-written backward, which "
                 "inference does not run")


@dataclass
class Source:
    """What is exported: the model's forward function, its parameters, tokenizer and description."""

    kind: str  # "classifier" or "encoder"
    model: Any  # EncoderConfig, with the export's attention kernel
    params: Any  # host numpy tree
    forward: Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]]  # (params, tokens, valid) -> outputs
    tokenizer: Any  # train.data.tokenizer.Tokenizer
    max_len: int
    buckets: list[int]  # the lengths the run padded to: the lengths a server warms
    labels: list[str] = field(default_factory=list)
    pooling: str = ""
    record: dict[str, Any] = field(default_factory=dict)  # where it came from, for the manifest


# --- what is exported ---------------------------------------------------------------------------


def _portable(model: Any) -> Any:
    """The model config with the export's attention kernel."""
    return model.with_kernel(KERNEL)


def from_workdir(workdir: Path, step: int | None = None) -> Source:
    """The run's best checkpoint (or `step`): a classifier, or the encoder of a masked-LM run."""
    from train.checkpoints.restore import restore_run
    from train.tasks import task_for

    run = restore_run(workdir, step)
    for note in run.notes:
        print(note, file=sys.stderr)
    task = task_for(run.config)
    model = _portable(run.config.model)
    params = jax.tree.map(np.asarray, run.params)
    record: dict[str, Any] = {"workdir": str(Path(workdir).absolute()), "step": run.step, "task": task.name,
                              "init_from": run.config.model.init_from}
    data = run.config.data
    max_len = min(data.max_len, model.max_len)
    buckets = sorted({b for b in data.buckets if b < max_len} | {max_len})
    kind, forward, kept, pooling = task.exported(model, params)
    return Source(kind, model, kept, forward, run.tokenizer, max_len, buckets,
                  run.label_names if kind == "classifier" else [], pooling, record)


def from_model(spec: str) -> Source:
    """A pretrained checkpoint (hf:<dir> or a packaged name), pooled as `train embed` pools it."""
    from jaxblock.model import Encoder
    from train.embed import Embedder, pool

    embedder = Embedder.load(spec)
    model = _portable(embedder.model)
    encoder, pooling = Encoder(model), embedder.pooling

    def embed(p: Any, tokens: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
        hidden: jax.Array = encoder.apply({"params": p}, tokens, valid)  # type: ignore[assignment]
        return {"embeddings": pool(hidden, valid, pooling)}

    described = "+".join(pooling.modes) + (", normalised" if pooling.normalize else "") + f" ({pooling.source})"
    return Source("encoder", model, jax.tree.map(np.asarray, embedder.params), embed, embedder.tokenizer,
                  embedder.max_len, embedder.buckets, pooling=described,
                  record={"model": spec, "path": str(embedder.directory)})


# --- writing ------------------------------------------------------------------------------------


def _platforms(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PLATFORMS]
    if unknown or not names:
        shown = unknown[0] if unknown else repr(text)
        raise UsageError(f"--platforms: unknown platform {shown}: use a comma-separated list of "
                         f"{', '.join(PLATFORMS)} (default {','.join(DEFAULT_PLATFORMS)})")
    return list(dict.fromkeys(names))


def _flat_params(params: Any) -> tuple[list[str], list[np.ndarray]]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in leaves]
    return names, [np.asarray(x) for _, x in leaves]


def lower(source: Source, platforms: list[str], params_in: str = "safetensors") -> tuple[Any, list[str]]:
    """The jax.export.Exported of `source` (params as constants, or as a first argument: a list in the
    order of the returned names) with symbolic batch b >= 1 and length 1 <= l <= max_len."""
    from jax import export

    shape = export.symbolic_shape("b, l", constraints=[f"l <= {source.max_len}"])  # b >= 1, l >= 1 implied
    inputs = (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.int32))
    names, leaves = _flat_params(source.params)
    treedef = jax.tree.structure(source.params)

    def with_params(flat: list[jax.Array], tokens: jax.Array, attention_mask: jax.Array) -> dict[str, jax.Array]:
        return source.forward(jax.tree.unflatten(treedef, flat), tokens, attention_mask > 0)

    if params_in == "artifact":
        constants = [jnp.asarray(x) for x in leaves]
        fn = jax.jit(lambda tokens, mask: with_params(constants, tokens, mask))
        return export.export(fn, platforms=platforms)(*inputs), names
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    return export.export(jax.jit(with_params), platforms=platforms)(specs, *inputs), names


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_params(path: Path, names: list[str], arrays: list[np.ndarray]) -> list[list[Any]]:
    """The parameters as one safetensors file; returns, in `names` order, [dtype, shape, byte offset in the
    file, element count] of each: what a reader with numpy alone needs (np.frombuffer)."""
    from safetensors.numpy import save_file

    save_file(dict(zip(names, arrays, strict=True)), str(path))
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [[str(x.dtype), list(x.shape), 8 + size + int(header[name]["data_offsets"][0]), int(x.size)]
            for name, x in zip(names, arrays, strict=True)]


def manifest(source: Source, exported: Any, platforms: list[str], names: list[str],
             layout: list[list[Any]] | None) -> dict[str, Any]:
    import jaxlib

    import jaxblock
    from jaxblock.attention import choose_implementation

    outputs = {name: {"dtype": str(aval.dtype), "shape": [str(d) for d in aval.shape]}
               for name, aval in zip(sorted(_output_names(source)), exported.out_avals, strict=True)}
    _, reason = choose_implementation(source.model.block, train=False)
    return {
        "format": FORMAT,
        "kind": source.kind,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "jaxblock_version": jaxblock.__version__,
        "calling_convention_version": exported.calling_convention_version,
        "platforms": platforms,
        "attention": {"kernel": KERNEL, "dispatch": reason, "why": KERNEL_REASON},
        "params": ({"in": MODEL_FILE, "what": "constants inside the StableHLO"} if layout is None else
                   {"in": PARAMS_FILE, "names": names, "layout": layout,
                    "what": "the call's first argument: a list of arrays in this order; layout gives each one's "
                            "[dtype, shape, byte offset in the file, element count] for np.frombuffer"}),
        "inputs": {
            "tokens": {"dtype": "int32", "shape": ["b", "l"],
                       "what": f"token ids: {TOKENIZER_FILE}'s encode_batch (it truncates to max_len and pads to "
                               "the longest text)"},
            "attention_mask": {"dtype": "int32", "shape": ["b", "l"],
                               "what": "1 for a real token, 0 for padding, real tokens first (encode_batch's "
                                       "attention_mask)"},
        },
        "constraints": ["b >= 1", f"1 <= l <= {source.max_len}"],
        "call": ("outputs = jax.export.deserialize(model.jax bytes).call(tokens, attention_mask)" if layout is None
                 else "outputs = jax.export.deserialize(model.jax bytes).call(params, tokens, attention_mask)"),
        "outputs": outputs,
        "labels": source.labels,
        "pooling": source.pooling,
        "max_len": source.max_len,
        "buckets": source.buckets,
        "tokenizer": {"file": TOKENIZER_FILE, "kind": source.tokenizer.kind, "pad_id": source.tokenizer.pad_id,
                      "truncation": source.max_len, "padding": "to the longest text, on the right"},
        "model": source.model.model_dump(mode="json"),
        "source": source.record,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trust": "an export is code: load only artifacts you trust (jax.export deserializes a program)",
    }


def _output_names(source: Source) -> list[str]:
    return ["embeddings", "logits", "probabilities"] if source.kind == "classifier" else ["embeddings"]


def write_export(source: Source, out: Path, platforms: list[str], params_in: str = "safetensors") -> dict[str, Any]:
    """Write the artifact of `source` into `out` (write, then rename); returns the manifest."""
    exported, names = lower(source, platforms, params_in)
    tokenizer = exported_tokenizer(source.tokenizer, source.max_len)

    def write(tmp: Path) -> dict[str, Any]:
        (tmp / MODEL_FILE).write_bytes(exported.serialize())
        layout = None
        if params_in == "safetensors":
            layout = write_params(tmp / PARAMS_FILE, names, _flat_params(source.params)[1])
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        info = manifest(source, exported, platforms, names, layout)
        info["files"] = {p.name: {"sha256": sha256(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST_FILE).write_text(json.dumps(info, indent=2) + "\n")
        return info

    return replace_dir(out, write, what="export")


# --- the command --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from train.cli import Parser, program

    p = Parser(prog=f"{program()} export", description="Write a trained run's inference (or a pretrained "
               "checkpoint's embeddings) as a jax.export artifact that loads without this repository, or as "
               "a transformers directory (--format hf). See docs/serving.md.")
    p.add_argument("--workdir", help="a trained run: its best checkpoint (else the latest) is exported")
    p.add_argument("--model", help="instead of --workdir: a pretrained checkpoint, hf:<dir> or a packaged name such "
                   "as hf:all-MiniLM-L6-v2 (its sentence embeddings)")
    p.add_argument("--step", type=int, help="the checkpoint to export (default: best if kept, else latest)")
    p.add_argument("--out", help=f"the directory to write (default: WORKDIR/{DEFAULT_DIR}); replaced if it holds an "
                   "earlier export")
    p.add_argument("--platforms", default=",".join(DEFAULT_PLATFORMS),
                   help=f"comma-separated, of {', '.join(PLATFORMS)} (default: %(default)s)")
    p.add_argument("--format", choices=["jax", "hf"], default="jax",
                   help="jax: the jax.export artifact (default); hf: a transformers directory")
    p.add_argument("--params", choices=["safetensors", "artifact"], default="safetensors",
                   help="where the parameters live: params.safetensors beside model.jax (default), or inside it as "
                   "constants (measured slower to compile and larger in memory: docs/serving.md)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if (args.workdir is None) == (args.model is None):
        raise UsageError("export: pass one of --workdir W (a trained run) or --model hf:<dir|name>")
    if args.model is not None and args.out is None:
        raise UsageError("export --model: pass --out DIR, the directory to write")
    out = Path(args.out) if args.out is not None else Path(args.workdir) / DEFAULT_DIR
    started = time.perf_counter()
    if args.format == "hf":
        if args.workdir is None:
            raise UsageError("export --format hf writes a trained run (--workdir); a pretrained checkpoint "
                             "already is a transformers directory")
        from train.export_hf import write_hf

        info = write_hf(Path(args.workdir), out, args.step)
        print(f"exported checkpoint {info['step']} of {args.workdir} as a transformers {info['architecture']} into "
              f"{out} ({time.perf_counter() - started:.0f}s)")
        return 0
    platforms = _platforms(args.platforms)
    if args.workdir is not None:
        if not Path(args.workdir).is_dir():
            raise CheckpointError(f"workdir {args.workdir} does not exist: pass the --workdir of a trained run")
        source = from_workdir(Path(args.workdir), args.step)
    else:
        source = from_model(args.model)
    info = write_export(source, out, platforms, args.params)
    size = sum(f["bytes"] for f in info["files"].values()) / 2**20
    what = (f"a classifier over {len(source.labels)} labels" if source.kind == "classifier" else
            f"an encoder ({info['outputs']['embeddings']['shape'][1]}-dim embeddings)")
    step = f"checkpoint {source.record['step']} of {args.workdir}" if args.workdir else args.model
    print(f"exported {step}: {what}, tokens up to {source.max_len}, for {','.join(platforms)}, into {out} "
          f"({size:.1f} MiB, {time.perf_counter() - started:.0f}s); load it with {', '.join(LOADER_PACKAGES[:-1])} "
          f"and {LOADER_PACKAGES[-1]} (pip install {' '.join(LOADER_PACKAGES)}; docs/serving.md)")
    return 0
