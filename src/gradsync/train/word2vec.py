"""Skip-gram word2vec with negative sampling (Mikolov et al. 2013) over stdlib tokens (tokens.py).

Vocabulary
    V        vocabulary size;  D  embedding dimension;  K  negatives per pair
    in, out  two V x D tables: ``in_embed`` embeds the centre token, ``out_embed`` the context and
             the negatives; ``in_embed`` is the embedding that neighbours are read from
    sample   ids [c, o, n_1 .. n_K];  score_j = <in[c], out[j]> for j in (o, n_1 .. n_K)

Loss per sample (the mean over the batch is what trains and what the held-out loss reports):
    L = -log sigma(score_o) - sum_k log sigma(-score_{n_k})
"accuracy" in the report is how often the true context scores above all K negatives.

Each step touches at most B*(2+K) rows of the 2*V, which is why the parameter server pushes and pulls
them sparsely (``make_sparse`` and ``rows_needed``); ddp and zero1 train the same model with dense
tables, all-reducing every row.
"""

from __future__ import annotations

import torch
from torch import nn

PROBES = ("append", "self", "True", "import", "==", "len", "except", "(")


class SkipGram(nn.Module):
    """Two V x D tables; forward(samples) -> scores (B, 1 + K), the context's first."""

    def __init__(self, vocab_size: int, dim: int = 128) -> None:
        super().__init__()
        self.in_embed = nn.Embedding(vocab_size, dim)
        self.out_embed = nn.Embedding(vocab_size, dim)
        nn.init.uniform_(self.in_embed.weight, -0.5 / dim, 0.5 / dim)   # word2vec.c's initialisation
        nn.init.zeros_(self.out_embed.weight)

    def forward(self, samples: torch.Tensor) -> torch.Tensor:
        centre = self.in_embed(samples[:, 0])                        # B x D
        others = self.out_embed(samples[:, 1:])                      # B x (1+K) x D
        return torch.bmm(others, centre.unsqueeze(2)).squeeze(2)

    def make_sparse(self) -> None:
        """Sparse gradients for both tables (what the parameter server pushes row by row)."""
        self.in_embed.sparse = self.out_embed.sparse = True

    @staticmethod
    def rows_needed(samples: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows a batch reads, per table: what a worker pulls before computing it."""
        return {"in_embed.weight": samples[:, 0].to(torch.int64),
                "out_embed.weight": samples[:, 1:].reshape(-1).to(torch.int64)}


def skip_gram(dim: int = 128) -> SkipGram:
    """The built-in word2vec model (train/tasks.py): over the stdlib-tokens vocabulary, its tables sparse, so
    that the parameter server moves only the rows a step touches (the other strategies make them dense)."""
    from gradsync.train import tokens

    model = SkipGram(len(tokens.vocabulary()), dim)
    model.make_sparse()
    return model


def negative_sampling_loss(scores: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of -log sigma(score_o) - sum_k log sigma(-score_k); ``targets`` (all 0: the
    context's score comes first) are not needed, and taken so that it serves as a --loss function."""
    return -(nn.functional.logsigmoid(scores[:, 0]) + nn.functional.logsigmoid(-scores[:, 1:]).sum(1)).mean()


@torch.no_grad()
def nearest(model: SkipGram, vocab: list[str], token: str, k: int = 5) -> list[tuple[str, float]]:
    """The k tokens whose ``in`` vectors have the largest cosine similarity with ``token``'s (itself excluded)."""
    table = nn.functional.normalize(model.in_embed.weight.float(), dim=1)
    similarity = table @ table[vocab.index(token)]
    similarity[vocab.index(token)] = -2.0
    best = similarity.topk(k)
    return [(vocab[i], float(s)) for s, i in zip(best.values, best.indices)]


def neighbour_rank(model: SkipGram, vocab: list[str], token: str, partner: str) -> int:
    """Where ``partner`` falls among ``token``'s neighbours by cosine similarity (1 = nearest)."""
    table = nn.functional.normalize(model.in_embed.weight.detach().float(), dim=1)
    similarity = table @ table[vocab.index(token)]
    similarity[vocab.index(token)] = -2.0
    return int((similarity > similarity[vocab.index(partner)]).sum()) + 1


def probe_report(model: SkipGram, vocab: list[str], k: int = 5) -> list[str]:
    """One line per probe token present in the vocabulary: its k nearest neighbours."""
    lines = []
    for token in PROBES:
        if token in vocab:
            near = ", ".join(f"{t} {s:.2f}" for t, s in nearest(model, vocab, token, k))
            lines.append(f"  {token!r:>10}: {near}")
    return lines


def print_neighbours(results: list[dict], k: int = 5) -> None:
    """After `gradsync train --model word2vec`: the probes' nearest neighbours in the trained model (any rank's
    parameters: every strategy ends with the same full tables on the ranks that return them)."""
    from gradsync.train import tokens

    trained = [r for r in results if (r.get("ps") or {}).get("role") != "server"]   # a server's model is stale
    params = next((r["params"] for r in trained if r.get("params") and "in_embed.weight" in r["params"]), None)
    if params is None:
        return
    vocab = tokens.vocabulary()
    model = SkipGram(len(vocab), params["in_embed.weight"].shape[1])
    model.load_state_dict(params)
    print(f"nearest neighbours (cosine, in-embeddings, {len(vocab)} tokens):")
    print("\n".join(probe_report(model, vocab, k)), flush=True)
