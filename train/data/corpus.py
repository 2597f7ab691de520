"""A synthetic English-like corpus of any size, for streaming tests and benches.

Sentences come from a seeded grammar with structure a masked language model can learn beyond word
frequencies: subject-verb number agreement (also across an intervening noun), names and nouns copied
within a sentence, and fixed function words. Words follow a Zipf law, so the unigram baseline is
realistic. The lexicon and every sentence are a function of the seed.

Writes one sentence per line (`text`) or JSON objects {"text": ...} (`jsonl`). Multi-GB files are quick:
sentences are generated in vectorised chunks, and past `fresh_bytes` the writer re-samples generated
sentences (a corpus that large exercises the reader, not the model).

Command: python -m train.data.corpus OUT --size 2GB [--format jsonl] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["Lexicon", "generate_corpus", "parse_size", "sentences"]

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "pl", "gr", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CHUNK = 50_000


class Lexicon:
    """Seeded pseudo-words: nouns (plural +s), verbs (3rd person singular +s), adjectives, adverbs, names."""

    def __init__(self, seed: int, size: int = 120):
        rng = np.random.default_rng([seed, 17])
        words: set[str] = set()
        while len(words) < 5 * size:
            n = int(rng.integers(1, 4))
            words.add("".join(str(rng.choice(_ONSETS)) + str(rng.choice(_VOWELS)) for _ in range(n)))
        pool = sorted(words)
        order = rng.permutation(len(pool))
        picks = [pool[i] for i in order]
        self.nouns = np.array(picks[:size])
        self.verbs = np.array(picks[size:2 * size])
        self.adjectives = np.array([w + "y" for w in picks[2 * size:3 * size]])
        self.adverbs = np.array([w + "ly" for w in picks[3 * size:4 * size]])
        self.names = np.array([w.capitalize() for w in picks[4 * size:5 * size]])
        weights = 1.0 / np.arange(1, size + 1)
        self.zipf = weights / weights.sum()


def _pick(rng: np.random.Generator, words: np.ndarray, zipf: np.ndarray, n: int) -> np.ndarray:
    return words[rng.choice(len(words), size=n, p=zipf)]


def sentences(lexicon: Lexicon, rng: np.random.Generator, n: int) -> list[str]:
    """`n` sentences from four templates (agreement, agreement across an attractor, two copy patterns)."""
    lx = lexicon
    noun, noun2, verb = (_pick(rng, w, lx.zipf, n) for w in (lx.nouns, lx.nouns, lx.verbs))
    adj, adv, name, name2 = (_pick(rng, w, lx.zipf, n) for w in (lx.adjectives, lx.adverbs, lx.names, lx.names))
    plural = rng.random(n) < 0.5
    kind = rng.integers(0, 4, n)
    out = []
    for i in range(n):
        s_noun = noun[i] + "s" if plural[i] else noun[i]
        s_verb = verb[i] if plural[i] else verb[i] + "s"
        k = kind[i]
        if k == 0:
            out.append(f"the {adj[i]} {s_noun} {s_verb} the {noun2[i]} .")
        elif k == 1:
            out.append(f"the {s_noun} near the {noun2[i]}s {s_verb} {adv[i]} .")
        elif k == 2:
            out.append(f"{name[i]} gave {name2[i]} a {noun[i]} and {name2[i]} thanked {name[i]} .")
        else:
            out.append(f"{name[i]} likes {noun[i]}s because {noun[i]}s are {adj[i]} .")
    return out


def generate_corpus(path: Path, size_bytes: int, *, seed: int = 0, fmt: str = "text",
                    fresh_bytes: int = 64 << 20) -> int:
    """Write about `size_bytes` (at least, to the next whole line) to `path`; returns the line count."""
    if fmt not in ("text", "jsonl"):
        raise ValueError(f"unknown corpus format '{fmt}': use text or jsonl")
    lexicon = Lexicon(seed)
    rng = np.random.default_rng([seed, 23])
    written = lines = 0
    pool: list[bytes] = []
    pool_bytes = 0
    with open(path, "wb") as f:
        while written < size_bytes:
            if pool_bytes < fresh_bytes:
                texts = sentences(lexicon, rng, _CHUNK)
                rows = [(json.dumps({"text": t}) if fmt == "jsonl" else t).encode() + b"\n" for t in texts]
                pool.extend(rows)
                pool_bytes += sum(len(r) for r in rows)
            else:  # re-sample what was generated: the bytes a reader sees, at write speed
                idx = rng.integers(0, len(pool), _CHUNK * 4)
                rows = [pool[i] for i in idx]
            chunk = b"".join(rows)
            if written + len(chunk) > size_bytes:  # stop at the first line that reaches the size
                cut = chunk.find(b"\n", size_bytes - written - 1) + 1
                chunk = chunk[:cut]
            f.write(chunk)
            written += len(chunk)
            lines += chunk.count(b"\n")
    return lines


def parse_size(text: str) -> int:
    """'200MB', '2GB', '512k', '1000' -> bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in "KMG" else ""
    try:
        return int(float(t[:len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise ValueError(f"size '{text}' is not a size: write e.g. 200MB or 2GB") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="file to write (overwritten)")
    parser.add_argument("--size", default="10MB", help="bytes to write, e.g. 200MB, 2GB")
    parser.add_argument("--format", choices=["text", "jsonl"], default="text")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        size = parse_size(args.size)
        if not args.out.parent.is_dir():
            raise ValueError(f"directory {args.out.parent} does not exist: create it or choose another path")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines = generate_corpus(args.out, size, seed=args.seed, fmt=args.format)
    print(f"wrote {args.out}: {args.out.stat().st_size} bytes, {lines} lines ({args.format}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
