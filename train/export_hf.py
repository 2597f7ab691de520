"""`python -m train export --format hf`: a trained run as a transformers directory (config.json with the
labels as id2label, model.safetensors, the tokenizer), through `jaxblock.interop.hf.to_hf`; it needs the
`hf` extra. Written as the jax.export artifact is (train/workdir/files.py `replace_dir`): into a new directory,
renamed into place at the end."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.errors import ConfigError
from train.export_tokenizer import exported_tokenizer
from train.workdir.files import replace_dir


def write_hf(workdir: Path, out: Path, step: int | None = None) -> dict[str, Any]:
    """A transformers directory of the run's best checkpoint (or `step`)."""
    from train.checkpoints.restore import restore_run

    run = restore_run(workdir, step)
    for note in run.notes:
        print(note, file=sys.stderr)
    if run.config.task not in ("classification", "mlm"):
        raise ConfigError(f"--format hf writes classifiers and encoders; the run in {workdir} is task="
                          f"{run.config.task}")
    params = jax.tree.map(np.asarray, run.params)
    params = params if run.config.task == "classification" else params["encoder"]
    info = write_hf_dir(run.config.model, params, run.tokenizer, run.label_names, run.config.data.max_len, out)
    return {**info, "step": run.step}


def write_hf_dir(model_config: Any, params: Any, tokenizer: Any, labels: list[str], max_len: int,
                 out: Path) -> dict[str, Any]:
    """config.json (id2label), model.safetensors and the tokenizer of Classifier params (a
    *ForSequenceClassification) or Encoder params (a base model), through jaxblock.interop.hf.to_hf."""
    try:
        import transformers  # noqa: F401

        from jaxblock.interop.hf import UnsupportedConfigError, to_hf
    except ImportError:
        raise ConfigError("--format hf needs transformers and torch: pip install -e '.[hf]'") from None
    try:
        model = to_hf(model_config, {"params": params}, pad_token_id=tokenizer.pad_id)
    except UnsupportedConfigError as err:
        raise ConfigError(f"--format hf: the run's model has no transformers equivalent ({err}): use the default "
                          "format (a jax.export artifact)") from None
    if labels:
        model.config.id2label = dict(enumerate(labels))
        model.config.label2id = {name: i for i, name in enumerate(labels)}
    hf_tokenizer = _hf_tokenizer(tokenizer, max_len)

    def write(tmp: Path) -> dict[str, Any]:
        with _no_progress_bars():  # "Writing model shards: 100%|...": the command prints its own line
            model.save_pretrained(str(tmp), safe_serialization=True)
            hf_tokenizer.save_pretrained(str(tmp))
        return {"architecture": type(model).__name__, "labels": labels}

    return dict(replace_dir(out, write, what="transformers export"))


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' (and huggingface_hub's) progress bars off, then as they were."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _hf_tokenizer(tokenizer: Any, max_len: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    hf = exported_tokenizer(tokenizer, max_len)
    hf.no_padding()
    hf.no_truncation()
    vocab = hf.get_vocab()
    special = {}
    for role, names in (("unk_token", ("[UNK]", "<unk>")), ("cls_token", ("[CLS]", "<s>")),
                        ("sep_token", ("[SEP]", "</s>")), ("mask_token", ("[MASK]", "<mask>"))):
        found = next((n for n in names if n in vocab), None)
        if found is not None:
            special[role] = found
    return PreTrainedTokenizerFast(tokenizer_object=hf, model_max_length=max_len,
                                   pad_token=hf.id_to_token(tokenizer.pad_id) or "<pad>", **special)
