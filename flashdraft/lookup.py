"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's last n-gram.

Text repeats itself (names, numbers, code identifiers, a phrase the answer echoes from the question). Where it does,
the repeat is a long draft that costs no drafter pass; decode (decode.py) verifies it like any other draft, so the
output is unchanged. Where nothing recurs, the drafter drafts as usual. With lookup="tree" and draft trees (temperature
0) the repeat instead becomes one more root path of the drafter's tree, and a cycle keeps whichever of the two the
target agrees with longer.
"""

from __future__ import annotations

import torch

# single-token matches propose too often and too wrongly (docs/how-it-works.md, "Prompt lookup")
MIN_NGRAM, MAX_NGRAM = 2, 4
# A recurring n-gram is often right for a long stretch, and on a CPU a verify of 8 rows costs little more than one of
# 4 (1.25 against 1.11 decode steps on a 2-core Xeon), so a lookup cycle verifies at least this many positions even
# when the drafter's block is smaller.
LOOKUP_BLOCK = 8


def lookup_drafts(tokens: list[int], k: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest recurring suffix n-gram of tokens.

    Suffixes of max_ngram down to min_ngram tokens are tried; [] when none occurs earlier (or k < 1). A match that
    runs into the end of the context continues periodically: a loop of period p is drafted k tokens deep.
    """
    if k < 1 or len(tokens) <= min_ngram:
        return []
    t = torch.tensor(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = t[:-1].unfold(0, n, 1)  # [L-n, n]: every n-gram that has a token after it (excludes the suffix)
        hits = (windows == t[-n:]).all(1).nonzero()
        if len(hits):
            j = int(hits[-1]) + n
            out, period = tokens[j:j + k], len(tokens) - j
            while len(out) < k:
                out.append(out[len(out) - period])
            return out
    return []


def one_hot_q(drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """The proposal distribution of a deterministic draft: q [k, V] puts all mass on each drafted token."""
    return torch.nn.functional.one_hot(drafts, vocab).float()
