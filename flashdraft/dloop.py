"""DLoop: run the drafter for several stages per cycle while it is confident, then verify everything at once.

Stage s (1-based) runs the same drafter on an extended block at positions start .. start + s·(b−1): the anchor and
all drafts of stages 1..s−1 as inputs (the target's embeddings of those tokens, exactly as the anchor is fed),
followed by b−1 mask tokens. The drafter attends to its cached context (committed target features, unchanged) and to
the whole extended block, so later stages condition on the proposed, still unverified prefix through the block
inputs: no new weights, the checkpoint format is unchanged. Stage 1 is exactly plain DFlash.

After stage s the gate statistic Σ_k log q_k(d_k) over that stage's drafts (q: the distribution each draft came
from) decides: another stage runs only if s < S, the statistic > gate, and the longer block still ends before the
decode loop's end (the prompt plus max_new_tokens, capped by the target's context): like the last blocks of plain
DFlash, no position is verified whose token could not be emitted. The target then verifies anchor + all drafts in one
forward pass with the usual rules (decode.py).
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from .decode import DecodeState, Proposer, stage_drafter
from .errors import FlashdraftError
from .sampling import SamplingParams


def check_loop(stages: int, gate: float) -> None:
    """One-line errors for loop settings that cannot work."""
    if not isinstance(stages, int) or stages < 1:
        raise FlashdraftError(f"loop stages must be an integer >= 1 (1 = plain DFlash, no looping), got {stages}")
    if not isinstance(gate, (int, float)) or math.isnan(gate):
        raise FlashdraftError(f"loop gate must be a number (a log-probability such as -0.75), got {gate}")


def stage_confidence(drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor) -> float:
    """Σ_k log q_k(d_k): q is the proposal the drafts were sampled from, or softmax(raw logits) at temperature 0."""
    k = torch.arange(drafts.shape[0], device=drafts.device)
    logq = q[k, drafts].log() if q is not None else torch.log_softmax(logits.float(), -1)[k, drafts]
    return float(logq.sum())


def fits(start: int, stages: int, n: int, end: int) -> bool:
    """Whether anchor + stages·n drafts at positions start.. stay before `end` (the decode loop's verify limit)."""
    return start + 1 + stages * n <= end


def looped_proposer(model: PreTrainedModel, drafter: torch.nn.Module, params: SamplingParams,
                    gen: torch.Generator | None, stages: int, gate: float) -> Proposer:
    """Up to `stages` drafting stages of b-1 tokens per cycle, each continuing from the drafts before it."""
    check_loop(stages, gate)
    draft = stage_drafter(model, drafter, params, gen)

    def propose(state: DecodeState, start: int, b: int):
        n = b - 1
        feats = state.take_pending()[None]  # committed features enter the drafter's cache once, in stage 1
        inputs, drafts, qs = [state.tokens[-1]], [], []
        for s in range(1, stages + 1):
            d, q, logits = draft(state.draft_cache, feats if s == 1 else feats[:, :0], inputs, start, n)
            drafts.append(d)
            qs.append(q)
            # Lossless at T > 0: whether stage s+1 exists depends only on tokens already drafted (a stopping time
            # of the draft sequence), never on the target, and each draft keeps the q it was sampled from given
            # its prefix; verification of any position is therefore unchanged by how many positions follow it.
            if s == stages or not fits(start, s + 1, n, state.end) or not stage_confidence(d, q, logits) > gate:
                break
            inputs += d.tolist()
        q_all = None if qs[0] is None else torch.cat(qs)
        return torch.cat(drafts), q_all

    return propose
