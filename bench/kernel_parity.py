"""Parity of the attention kernels against the dense kernel: max abs error of the output and of the
gradients of q, k, v, per kernel, mask kind and dtype. On this machine's backend: a TPU runs splash
compiled, a GPU runs the Pallas GPU kernel and cuDNN compiled, a CPU runs both Pallas kernels in interpret
mode (the reference is always the dense kernel in float32 on the same backend; the dense kernel in
bfloat16 is listed too, as the floor bfloat16 inputs set).

    python -m bench.kernel_parity                 # every kernel this backend can run, every mask kind
    python -m bench.kernel_parity --length 1024   # longer rows (several key blocks; slow in interpret mode)
    python -m bench.kernel_parity --json runs/bench/kernel_parity.json

Exit 0 when every error is within the stated tolerance (float32 2e-5 on outputs, 1e-4 on gradients;
bfloat16 inputs 4e-2 / 2e-1 of a float32 reference; the Pallas GPU kernel's float32 on a GPU, whose dots are
TF32, 2e-3 / 1e-2), 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.arguments import count

TOL = {"float32": (2e-5, 1e-4), "bfloat16": (4e-2, 2e-1)}
# The Pallas GPU kernel multiplies float32 in TF32 (Triton's default for a dot of DEFAULT precision, and the kernel
# takes no precision), so its float32 rows on a GPU are held to TF32's rounding (2**-11 relative), not float32's.
TOL_TF32 = (2e-3, 1e-2)
MASK_KINDS = ("padding", "no-key rows", "packed", "causal", "window", "causal+window", "GQA 4:1 packed")


def _inputs(kind: str, n: int, length: int, heads: int, kdim: int, seed: int = 0) -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    g = heads // 4 if kind.startswith("GQA") else heads
    lengths = [length, max(1, length * 3 // 5)] + [length // 2] * (n - 2)
    if kind == "no-key rows":
        lengths[-1] = 0
    valid = np.arange(length)[None, :] < np.asarray(lengths[:n])[:, None]
    seg = None
    if "packed" in kind:
        seg = jnp.asarray(np.broadcast_to(np.arange(length) // max(1, length // 3), (n, length)), jnp.int32)
    window = {"window": 16, "causal+window": 16}.get(kind)
    causal = kind in ("causal", "causal+window")
    q = rng.normal(size=(n, length, heads, kdim)).astype(np.float32)
    k = rng.normal(size=(n, length, g, kdim)).astype(np.float32)
    v = rng.normal(size=(n, length, g, kdim)).astype(np.float32) * valid[:, :, None, None]
    return dict(q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v), valid=jnp.asarray(valid), seg=seg,
                window=window, causal=causal)


def kernels_for(backend: str) -> dict[str, Any]:
    """name -> fn(q, k, v, valid, causal=, segment_ids=, window=) for the kernels this backend runs."""
    import jax.numpy as jnp

    from jaxblock import masks
    from jaxblock.attention import dense_attention
    from jaxblock.attention.gpu import pallas_gpu_attention
    from jaxblock.attention.splash import splash_attention

    def dense(q: Any, k: Any, v: Any, valid: Any, *, causal: bool, segment_ids: Any, window: Any) -> Any:
        m = masks.attention_mask(valid, causal=causal, segment_ids=segment_ids,
                                 window=None if window is None else jnp.asarray(window))
        return dense_attention(q, k, v, m, jnp.any(m[:, 0], axis=-1))

    # The dense kernel itself in bfloat16 gives the floor that bfloat16 inputs set for every kernel.
    out: dict[str, Any] = {"dense": dense}
    if backend in ("tpu", "cpu"):
        out["splash"] = lambda q, k, v, valid, **kw: splash_attention(q, k, v, valid, interpret=backend != "tpu", **kw)
    if backend in ("gpu", "cpu"):
        def pallas(q: Any, k: Any, v: Any, valid: Any, *, window: Any, **kw: Any) -> Any:
            if window is not None:
                raise NotImplementedError("windows go to XLA on a GPU")
            return pallas_gpu_attention(q, k, v, valid, interpret=backend != "gpu", **kw)

        out["pallas_gpu"] = pallas
    if backend == "gpu":
        out["cudnn"] = _cudnn
    return out


def _cudnn(q: Any, k: Any, v: Any, valid: Any, *, causal: bool, segment_ids: Any, window: Any) -> Any:
    import jax.numpy as jnp

    from jaxblock import masks
    from jaxblock.attention.xla import fused_attention

    if segment_ids is not None or window is not None or q.dtype == jnp.float32:
        raise NotImplementedError("cuDNN takes half precision with lengths and causal only")
    mask = masks.attention_mask(valid, causal=causal)
    return fused_attention(q, k, v, mask, valid, "cudnn", causal=causal, plain=True)


def measure(name: str, fn: Any, kind: str, dtype: str, n: int, length: int) -> dict[str, Any] | None:
    import jax
    import jax.numpy as jnp

    from jaxblock import masks
    from jaxblock.attention import dense_attention

    x = _inputs(kind, n, length, heads=8, kdim=64 if jax.default_backend() != "cpu" else 16)
    valid, seg, causal, window = x["valid"], x["seg"], x["causal"], x["window"]
    real = valid[:, :, None, None]
    weights = jax.random.normal(jax.random.key(1), x["q"].shape)
    dt = jnp.dtype(dtype)

    def ours(q: Any, k: Any, v: Any) -> Any:
        return fn(q, k, v, valid, causal=causal, segment_ids=seg, window=window).astype(jnp.float32)

    def ref(q: Any, k: Any, v: Any) -> Any:
        m = masks.attention_mask(valid, causal=causal, segment_ids=seg,
                                 window=None if window is None else jnp.asarray(window))
        return dense_attention(q, k, v, m, jnp.any(m[:, 0], axis=-1))

    def loss(f: Any) -> Any:
        return lambda *a: jnp.sum(jnp.where(real, f(*a) * weights, 0.0))

    def value_and_grads(f: Any, *args: Any) -> Any:
        return f(*args), jax.grad(loss(f), argnums=(0, 1, 2))(*args)

    t0 = time.perf_counter()
    try:
        out, got = jax.jit(lambda *a: value_and_grads(ours, *(t.astype(dt) for t in a)))(x["q"], x["k"], x["v"])
    except NotImplementedError:
        return None
    with jax.default_matmul_precision("highest"):  # the reference in float32 itself, not TF32, on a GPU
        want, exp = jax.jit(lambda *a: value_and_grads(ref, *a))(x["q"], x["k"], x["v"])
    # Errors on real query positions (the Pallas GPU kernel sets padded queries to 0; every kernel's
    # output there is finite): the gradients come from a loss on real positions.
    err = [float(jnp.max(jnp.abs(jnp.where(real, out - want, 0.0))))]
    err += [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) for a, b in zip(got, exp, strict=True)]
    scale = float(jnp.max(jnp.abs(want)))
    finite = all(bool(jnp.all(jnp.isfinite(a))) for a in (out, *got))
    tf32 = name == "pallas_gpu" and dtype == "float32" and jax.default_backend() == "gpu"
    tol_out, tol_grad = TOL_TF32 if tf32 else TOL[dtype]
    ok = finite and err[0] <= tol_out * max(1.0, scale) and max(err[1:]) <= tol_grad * max(1.0, scale)
    return dict(kernel=name, mask=kind, dtype=dtype, L=length, out=err[0], dq=err[1], dk=err[2], dv=err[3],
                finite=finite, ok=ok, tolerance="tf32" if tf32 else dtype, seconds=round(time.perf_counter() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernel_parity", description=__doc__.split("\n")[0])
    p.add_argument("--length", type=count, default=200, help="L (default 200: not a multiple of 128)")
    p.add_argument("--rows", type=count, default=2, help="N (at least 2: one full row, one padded)")
    p.add_argument("--only", default="", help="comma-separated kernels (default: all this backend runs)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.rows < 2:
        print("python -m bench.kernel_parity: --rows must be at least 2 (a full row and a padded one)", file=sys.stderr)
        return 2
    import jax

    backend = jax.default_backend()
    kernels = kernels_for(backend)
    chosen = [k.strip() for k in args.only.split(",") if k.strip()] or list(kernels)
    unknown = [k for k in chosen if k not in kernels]
    if unknown:
        print(f"python -m bench.kernel_parity: {unknown[0]} does not run on {backend}: pick from "
              f"{', '.join(kernels)}", file=sys.stderr)
        return 2
    print(f"backend {backend} ({jax.devices()[0].device_kind}); reference: the dense kernel in float32; "
          f"{'interpret mode' if backend == 'cpu' else 'compiled'}", flush=True)
    rows = []
    print(f"{'kernel':<11} {'mask':<15} {'dtype':<9} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}  ok", flush=True)
    for name in chosen:
        for dtype in ("float32", "bfloat16"):
            if name == "dense" and dtype == "float32":
                continue  # the reference itself
            for kind in MASK_KINDS:
                row = measure(name, kernels[name], kind, dtype, args.rows, args.length)
                if row is None:
                    continue
                rows.append(row)
                print(f"{name:<11} {kind:<15} {dtype:<9} {row['out']:9.2e} {row['dq']:9.2e} {row['dk']:9.2e} "
                      f"{row['dv']:9.2e}  {'yes' if row['ok'] else 'NO'}"
                      f"{' (TF32 tolerance)' if row['tolerance'] == 'tf32' else ''}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"backend": backend, "rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"]]
    f32 = [r["out"] for r in rows if r["dtype"] == "float32"]
    worst = f"; worst float32 output error {max(f32):.2e}" if f32 else ""
    print(f"{len(rows)} cases, {len(bad)} outside tolerance{worst}")
    return 1 if bad else 0


if __name__ == "__main__":
    from train import platforms

    platforms.choose("bench")  # as `python -m train`: no compiler plugin's warnings about a chip this host lacks
    sys.exit(main())
