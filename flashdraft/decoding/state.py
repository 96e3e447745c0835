"""What a generation carries between cycles, and what it reports: state, cycles, timing, the result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from ..drafter import ContextCache


def mean_acceptance(lengths: list[int]) -> float:
    """τ: the mean acceptance length (tokens per target verify) over cycles; 0 when nothing was verified."""
    return sum(lengths) / len(lengths) if lengths else 0.0


@dataclass
class DecodeState:
    """Everything that must stay aligned: emitted tokens, target cache, drafter context cache."""

    tokens: list[int]  # prompt + emitted; the last one is the next anchor (not yet in the target cache)
    num_prompt_tokens: int
    target_cache: DynamicCache
    end: int  # positions < end may be verified: prompt + max_new_tokens, capped by the context (official max_length)
    draft_cache: ContextCache = field(default_factory=ContextCache)
    pending_features: torch.Tensor | None = None  # [n, F] committed positions not yet in draft_cache

    @property
    def committed(self) -> int:
        return self.target_cache.get_seq_length()

    def take_pending(self) -> torch.Tensor:
        feats, self.pending_features = self.pending_features, None
        return feats

    def add_pending(self, feats: torch.Tensor) -> None:
        p = self.pending_features
        self.pending_features = feats if p is None else torch.cat([p, feats], 0)


@dataclass
class Cycle:
    block: list[int]  # exactly the ids the target verified
    accepted: int  # drafts kept
    emitted: list[int]  # tokens this cycle added to the output (after stop / length truncation)
    stages: int = 0  # drafting stages of b-1 drafts each behind this block (1: plain DFlash or a tree; 0: block size
    # 1 or a lookup draft alone)
    lookup: bool = False  # prompt lookup (lookup.py) drafted: the whole chain, or one path of a tree (lookup="tree")
    parents: list[int] | None = None  # a draft tree (tree.py): each draft's parent among the drafts, -1: the anchor


@dataclass
class Timing:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    tokens_per_s: float = 0.0

    def close(self, total_s: float, new_tokens: int) -> None:
        """Set the total; what prefill, drafting and verification do not explain is `other`."""
        self.total_s = total_s
        self.other_s = max(0.0, total_s - self.prefill_s - self.draft_s - self.verify_s)
        self.tokens_per_s = new_tokens / total_s if total_s > 0 else 0.0


@dataclass
class GenerationResult:
    output_ids: list[int]
    num_prompt_tokens: int
    cycles: list[Cycle]
    timing: Timing
    config: dict
    text: str = ""

    @property
    def num_new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def acceptance_lengths(self) -> list[int]:
        return [c.accepted + 1 for c in self.cycles]

    @property
    def tau(self) -> float:
        """Mean acceptance length over cycles (tokens per target verify)."""
        return mean_acceptance(self.acceptance_lengths)

    @property
    def lookup_cycles(self) -> int:
        """Cycles that verified a prompt-lookup draft (alone, or as one path of the drafter's tree)."""
        return sum(c.lookup for c in self.cycles)

    @property
    def mean_stages(self) -> float:
        """Mean drafting stages per cycle (1.0 for plain DFlash; above 1 when DLoop drafted further stages)."""
        return sum(c.stages for c in self.cycles) / len(self.cycles) if self.cycles else 0.0

    def to_record(self) -> dict:
        """The machine-readable record of docs/design.md §7."""
        return {
            "output_ids": self.output_ids, "text": self.text, "num_prompt_tokens": self.num_prompt_tokens,
            "num_new_tokens": self.num_new_tokens, "acceptance_lengths": self.acceptance_lengths,
            "cycles": [{"block": c.block, "accepted": c.accepted, "stages": c.stages, "lookup": c.lookup,
                        "parents": c.parents}
                       for c in self.cycles],
            "timing": asdict(self.timing), "config": self.config,
        }
