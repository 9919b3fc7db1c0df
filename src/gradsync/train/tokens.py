"""stdlib-tokens: skip-gram pairs with negative samples from the running interpreter's own stdlib sources.

Recipe (every rank builds the same tensors; the tokenised corpus is cached on disk, see cache_path)
    tokenise     every .py file under the stdlib (sorted paths; site-packages skipped) with the
                 tokenize module, keeping NAME tokens (names and keywords) and OP tokens (operators and
                 punctuation), until ``max_tokens`` are read
    vocabulary   the ``vocab_size`` most frequent tokens, numbered by frequency (id 0 is the most
                 frequent; ties by the token's text); other tokens are dropped, as word2vec's min-count
    split        the first 90% of the token stream trains, the last 10% (other files) is held out
    subsample    a token of corpus frequency f is kept with probability min(1, sqrt(t/f) + t/f),
                 t = 1e-4 (Mikolov et al. 2013), which thins '(' ')' ',' '.' about 30-fold
    pairs        each kept token (centre) with each neighbour within ``window`` positions (context)
    negatives    ``negatives`` ids per pair drawn from the unigram distribution raised to 3/4

A sample is one row of int64 ids [centre, context, negative_1 .. negative_K]; the label is 0 (the
context's score comes first among the 1 + K scores: see word2vec.py). Draws use fixed seeds, so
every strategy trains and is scored on exactly the same samples.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
import tokenize
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

MAX_TOKENS = 1_500_000
VOCAB_SIZE = 50_000
WINDOW = 2
NEGATIVES = 5
SUBSAMPLE_T = 1e-4
HELD_OUT = 0.1


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def tokenise(max_tokens: int) -> list[str]:
    """NAME and OP tokens of the stdlib, in file order, up to ``max_tokens``."""
    tokens: list[str] = []
    for path in stdlib_files():
        try:
            with open(path, "rb") as source:
                for token in tokenize.tokenize(source.readline):
                    if token.type in (tokenize.NAME, tokenize.OP):
                        tokens.append(token.string)
        except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, OSError):
            continue   # a file the running tokenizer cannot read (old syntax, odd encoding): skip it whole
        if len(tokens) >= max_tokens:
            break
    if len(tokens) < 1000:
        raise RuntimeError(f"found only {len(tokens)} tokens of Python source under the stdlib; stdlib-tokens needs more")
    return tokens[:max_tokens]


def cache_path(max_tokens: int, vocab_size: int) -> Path:
    """Where the tokenised corpus is kept (GRADSYNC_CACHE, default the temp directory)."""
    root = Path(os.environ.get("GRADSYNC_CACHE", Path(tempfile.gettempdir()) / "gradsync-cache"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return root / f"stdlib-tokens-py{version}-{max_tokens}-{vocab_size}.pt"


def corpus(max_tokens: int = MAX_TOKENS, vocab_size: int = VOCAB_SIZE) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(vocabulary, counts per id, token ids of the stream with out-of-vocabulary tokens dropped)."""
    path = cache_path(max_tokens, vocab_size)
    if path.exists():
        try:
            saved = torch.load(path, weights_only=True)
            return saved["vocab"], saved["counts"], saved["ids"]
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt
            pass
    tokens = tokenise(max_tokens)
    ranked = sorted(Counter(tokens).items(), key=lambda item: (-item[1], item[0]))[:vocab_size]
    vocab = [token for token, _ in ranked]
    index = {token: i for i, token in enumerate(vocab)}
    ids = torch.tensor([index[t] for t in tokens if t in index], dtype=torch.int64)
    counts = torch.tensor([count for _, count in ranked], dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"vocab": vocab, "counts": counts, "ids": ids}, partial)
    os.replace(partial, path)    # atomic: ranks building it at once each write their own, the last wins
    return vocab, counts, ids


def skipgram_samples(ids: torch.Tensor, counts: torch.Tensor, window: int, negatives: int,
                     generator: torch.Generator) -> torch.Tensor:
    """Rows [centre, context, negatives...] from a token stream (see module docstring)."""
    frequency = counts.double() / counts.sum()
    keep_p = ((SUBSAMPLE_T / frequency).sqrt() + SUBSAMPLE_T / frequency).clamp(max=1.0)
    kept = ids[torch.rand(ids.numel(), generator=generator, dtype=torch.float64) < keep_p[ids]]
    centres, contexts = [], []
    for offset in range(1, window + 1):
        centres += [kept[:-offset], kept[offset:]]
        contexts += [kept[offset:], kept[:-offset]]
    centre, context = torch.cat(centres), torch.cat(contexts)
    noise = counts.double() ** 0.75
    drawn = torch.multinomial(noise, centre.numel() * negatives, replacement=True, generator=generator)
    return torch.cat([centre.unsqueeze(1), context.unsqueeze(1), drawn.view(-1, negatives)], 1)


def stdlib_tokens(seed: int = 0, max_tokens: int = MAX_TOKENS, vocab_size: int = VOCAB_SIZE,
                  window: int = WINDOW, negatives: int = NEGATIVES) -> tuple[TensorDataset, TensorDataset]:
    """(train, held-out) TensorDatasets of (samples, labels = 0)."""
    _, counts, ids = corpus(max_tokens, vocab_size)
    cut = int((1 - HELD_OUT) * ids.numel())
    generator = torch.Generator().manual_seed(seed)
    train = skipgram_samples(ids[:cut], counts, window, negatives, generator)
    held_out = skipgram_samples(ids[cut:], counts, window, negatives, generator)
    return (TensorDataset(train, torch.zeros(len(train), dtype=torch.int64)),
            TensorDataset(held_out, torch.zeros(len(held_out), dtype=torch.int64)))


def vocabulary(max_tokens: int = MAX_TOKENS, vocab_size: int = VOCAB_SIZE) -> list[str]:
    return corpus(max_tokens, vocab_size)[0]
