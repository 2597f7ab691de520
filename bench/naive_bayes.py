"""The bag-of-words baseline: multinomial naive Bayes on unigram+bigram counts, on the model's own split.

    python -m bench.naive_bayes                                  # Rotten Tomatoes, default split
    python -m bench.naive_bayes --config configs/sentiment.yaml  # exactly that config's data split
    python -m bench.naive_bayes --source tweets data.split_seed=1

The texts come from `train.data.labelled.load_dataset`, so train/validation/test are the very examples the
classifier trains and is scored on. Exit codes: 0 success, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from train.config import ConfigError, DataConfig, load_config
from train.data.labelled import DataError, Dataset, load_dataset


def naive_bayes_accuracy(ds: Dataset) -> dict[str, float]:
    """Fit on the train split; accuracy on validation and test, with the majority-class rate for scale."""
    from sklearn.feature_extraction.text import CountVectorizer  # ~1.5 s to import: only when measuring
    from sklearn.naive_bayes import MultinomialNB

    # \w+ rather than scikit-learn's default \w\w+: single-character tokens ("I", the synthetic symbols)
    # are words too.
    vectorizer = CountVectorizer(ngram_range=(1, 2), token_pattern=r"(?u)\b\w+\b")
    features = vectorizer.fit_transform(ds.train.texts)
    model = MultinomialNB().fit(features, ds.train.labels)
    majority = int(np.bincount(ds.train.labels).argmax())
    out = {}
    for name in ("validation", "test"):
        split = getattr(ds, name)
        predicted = model.predict(vectorizer.transform(split.texts))
        out[f"{name}_accuracy"] = float(np.mean(predicted == split.labels))
        out[f"{name}_majority"] = float(np.mean(split.labels == majority))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.naive_bayes", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config whose data section (source, split, seed) to use")
    parser.add_argument("--source", choices=["rotten_tomatoes", "tweets", "amazon", "nyt", "file", "synthetic"],
                        help="data.source (default: the config's, else rotten_tomatoes)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.split_seed=1")
    args = parser.parse_args(argv)
    try:
        overrides = list(args.overrides)
        if args.source:
            overrides.append(f"data.source={args.source}")
        elif args.config is None:
            overrides.insert(0, "data.source=rotten_tomatoes")
        cfg: DataConfig = load_config(args.config, overrides).data
        # The split does not depend on the tokenizer; bytes skip training a BPE that naive Bayes never uses.
        ds = load_dataset(cfg.model_copy(update={"tokenizer": "byte"}))
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    acc = naive_bayes_accuracy(ds)
    print(f"naive Bayes (bag of unigrams+bigrams) on {cfg.source}: train {len(ds.train)}, "
          f"validation {len(ds.validation)}, test {len(ds.test)} examples; "
          f"validation accuracy {acc['validation_accuracy']:.4f}, test accuracy {acc['test_accuracy']:.4f} "
          f"(majority class {acc['test_majority']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
