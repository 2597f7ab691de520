"""One process of a small multi-host run, for tests/train/devices/test_multihost.py (also callable in-process).

    python tests/train/devices/multihost_driver.py --port P --num-processes 2 --process-id I --devices 4 --out DIR

Joins jax.distributed on 127.0.0.1:P with `--devices` CPU devices, trains STEPS sharded steps (FSDP 2 x
data, so parameters really are split across the hosts) on global batches that are a pure function of
the step, loads only this process's share of each, saves a checkpoint with train.checkpoints.store from every
process, and has process 0 write the losses and a final evaluation to DIR/result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

STEPS = 4
BATCH = 16
LENGTH = 8


def tiny_config(parallel: dict[str, Any]) -> Any:
    from train.config import config_from_dict

    return config_from_dict({
        "model": {"vocab_size": 16, "max_len": LENGTH, "num_layers": 1,
                  "block": {"model_dim": 16, "num_heads": 2, "ffn_dim": 32}},
        "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "train": {"batch_size": BATCH, "steps": STEPS},
        "checkpoint": {"async_save": False},
        "parallel": {"strategy": "sharded", "mesh": {"fsdp": 2}, **parallel},
    })


def global_batch(step: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(step)
    lengths = rng.integers(2, LENGTH + 1, BATCH)
    valid = np.arange(LENGTH)[None, :] < lengths[:, None]
    tokens = np.where(valid, rng.integers(1, 16, (BATCH, LENGTH)), 0).astype(np.int32)
    return {"tokens": tokens, "valid_tokens": valid, "labels": (tokens[:, 0] % 2).astype(np.int32)}


def run(parallel: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """Train and evaluate; save a checkpoint under `out` when given. Every process calls this.
    Returns the result (what result.json holds) plus the runner, final state, config, batch share
    and state constructor."""
    import jax

    from jaxblock import Classifier
    from train.checkpoints.store import Checkpoints
    from train.devices import hosts
    from train.devices import runners as par
    from train.loop.state import abstract_init, create_state, init_params

    config = tiny_config(parallel)
    hosts.initialize_distributed(config.parallel)
    model = Classifier(config.model)

    def make_state() -> Any:
        return create_state(model, init_params(model, 0, LENGTH), config.optim, STEPS)

    runner = par.make_runner(config, jax.eval_shape(make_state), specs=abstract_init(model, LENGTH)[1])
    state = runner.init_state(make_state)
    index, count = runner.data_share()
    per = BATCH // count

    def share(step: int) -> dict[str, Any]:
        return {k: v[index * per:(index + 1) * per] for k, v in global_batch(step).items()}

    losses = []
    for step in range(STEPS):
        state, metrics = runner.train_step(state, share(step), jax.random.fold_in(jax.random.key(0), step))
        losses.append(float(metrics["loss"]))  # every step: tiny run, no queue of collectives
    sums = runner.eval_step(state, share(100))
    result: dict[str, Any] = {"losses": losses, "eval_loss": float(sums["loss_sum"]) / float(sums["count"]),
                              "processes": jax.process_count(), "devices": jax.device_count(), "share": [index, count]}
    if out is not None:
        ckpts = Checkpoints(out, config.checkpoint)
        ckpts.save(runner.unreplicate(state), {"seed": 0, "label_names": ["even", "odd"]})
        ckpts.wait()
        ckpts.close()
        if hosts.is_primary():
            (out / "result.json").write_text(json.dumps(result))
    return {**result, "runner": runner, "state": state, "config": config, "share_of": share, "make_state": make_state}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    # Before JAX loads: this process's simulated CPU devices.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    run({"coordinator": f"127.0.0.1:{args.port}", "num_processes": args.num_processes,
         "process_id": args.process_id}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
