"""Reading positions of a streamed corpus (train/data/stream.py), kept per logical shard so that they do
not depend on the process count.

`BatchStream.get_state()` holds one Grain state per logical shard the process reads; `merge_states` joins
the states every process of a run saved into one that `BatchStream.set_state` accepts on any process
count dividing the shard count. `pipeline_state` / `wrapped_state` take the zipped shard pipelines' state
out of, and back into, Grain's state of the whole iterator (which a worker process wraps); `upgrade`
reads a state saved in the earlier per-process form (the whole iterator's state, the layout in the
identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from train.data.datasets import DataError


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state from the states every process of a run saved (each holds its own shards): what
    `BatchStream.set_state` takes on any process count. DataError if they disagree on the step or stream."""
    states = [upgrade(s) for s in states]
    if not states or any(s.get("identity") != states[0].get("identity") or s.get("step") != states[0].get("step")
                         for s in states):
        raise DataError("the saved input-stream states of the run's processes disagree (another stream or step): "
                        "the checkpoint is inconsistent; resume from an older checkpoint or start a new workdir")
    shards: dict[str, Any] = {}
    for s in states:
        shards.update(s["shards"])
    return {"identity": states[0]["identity"], "step": states[0]["step"], "shards": shards}


def pipeline_state(grain_state: dict[str, Any], prefetch: str | None) -> dict[str, Any]:
    """The state of the zipped shard pipelines inside Grain's state of the whole iterator: a worker process
    (mp_prefetch, one worker) wraps it as the state of the iterator it runs; a prefetch thread does not."""
    if prefetch == "process":
        (inner,) = grain_state["iterators_in_use_states"]
        return dict(inner)
    return grain_state


def wrapped_state(pipeline: dict[str, Any], iterator: Any, prefetch: str | None) -> dict[str, Any]:
    """Grain's state of the whole iterator holding `pipeline` (the inverse of `_pipeline_state`): for a
    worker process, the iterator's own state layout with the worker's iterator state replaced."""
    if prefetch != "process":
        return pipeline
    outer = dict(iterator.get_state())
    outer["iterators_in_use_states"] = [pipeline]
    return outer


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A state saved before positions were kept per shard ("grain": the whole iterator's state, identity
    with the process layout and prefetch mode) in today's form."""
    if "shards" in state or "grain" not in state:
        return state
    identity = dict(state.get("identity") or {})
    index, count, prefetch = identity.pop("process_index", 0), identity.pop("process_count", 1), identity.pop(
        "prefetch", None)
    config = identity.get("config") or {}
    parts = pipeline_state(state["grain"], prefetch)["parent"]["parents"]
    per = int(config.get("num_shards", len(parts) * count)) // int(count)
    shards = range(int(index) * per, (int(index) + 1) * per)  # train.data.stream.shard_range's split
    return {"identity": identity, "step": state["step"], "layout": [index, count],
            "shards": {str(s): part for s, part in zip(shards, parts, strict=True)}}
