"""Draft trees (greedy decoding): verify several continuations of one drafter pass at once, keep the longest match.

A drafter pass scores every block position in parallel, so besides its top-1 chain it offers runner-up tokens at
each position for free. A tree spends a fixed budget of verify rows on the continuations the drafter finds likeliest
(best-first on the summed log-probability of each path, as EAGLE-2 does) instead of on one chain: where the chain
would fail at its first token, a sibling often holds the target's choice. The target verifies all nodes in one
forward pass: each row sees the committed context and its own ancestors (target.tree_mask) at position start + depth.
The accepted path is the longest root path the target's argmax agrees with; its rows are then moved to be
contiguous in the target's cache (target.keep_rows), so the cache ends exactly as after a chain.

Only greedy decoding uses trees: at T > 0 the lossless rule for several drafts per position differs from the chain's
(decoding falls back to the chain there).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable


if TYPE_CHECKING:
    import torch

TREE_WIDTH = 4  # children considered per node; the budget, not the width, bounds the tree

# children(depth, parent token) -> (log-probabilities [M], token ids [M]) of the best M children of such a node
Children = Callable[[int, int], "tuple[torch.Tensor, torch.Tensor]"]


def best_first_tree(children: Children, anchor: int, depth: int, budget: int) -> tuple[list[int], list[int]]:
    """The `budget` nodes of highest path log-probability, at most `depth` deep → (tokens [N], parents [N]).

    parents[i] is the index of node i's parent among the nodes, -1 under the anchor; parents precede children.
    """
    tokens, parents, heap, tie = [], [], [], 0

    def push(d: int, prev: int, logp: float, parent: int) -> None:
        nonlocal tie
        lp, ids = children(d, prev)
        for a, t in zip(lp.tolist(), ids.tolist()):
            heapq.heappush(heap, (-(logp + a), tie, d, t, parent))
            tie += 1  # equal scores pop in push order: never compares token ids

    push(0, anchor, 0.0, -1)
    while heap and len(tokens) < budget:
        neg, _, d, t, parent = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        if d + 1 < depth:
            push(d + 1, t, -neg, len(tokens) - 1)
    return tokens, parents


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node below the anchor (children of the anchor have depth 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def child(tokens: list[int], parents: list[int], parent: int, token: int) -> int | None:
    """Index of the node holding `token` under node `parent` (-1: the anchor), or None."""
    return next((i for i, (t, p) in enumerate(zip(tokens, parents)) if t == token and p == parent), None)


def graft_chain(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """The tree with `chain` added as a root path, sharing the nodes it already has → (tokens, parents)."""
    tokens, parents, at = list(tokens), list(parents), -1
    for t in chain:
        node = child(tokens, parents, at, t)
        if node is None:
            tokens.append(t)
            parents.append(at)
            node = len(tokens) - 1
        at = node
    return tokens, parents


def accept_tree_greedy(tokens: list[int], parents: list[int], target_ids: list[int]) -> tuple[list[int], int]:
    """Target argmax ids [N+1] (row 0: the anchor) → (accepted node indices root→leaf, the target's next token)."""
    path, row = [], 0
    while True:
        want = target_ids[row]
        nxt = child(tokens, parents, row - 1, want)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt + 1
