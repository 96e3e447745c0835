"""One request from prompt to result: what it carries between cycles (tokens, room, samplers, caches), the stop and
length rules, what each cycle reports, and the record it turns into. Every engine's decoding loop keeps its requests
here: the torch decoder (decoder.py), MLX (mlx/decode.py) and the server's worker.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from ..drafter import ContextCache
from .adaptive import Acceptance
from .settings import DecodeSettings


def mean_acceptance(lengths: list[int]) -> float:
    """τ: the mean acceptance length (tokens per target verify) over cycles; 0 when nothing was verified."""
    return sum(lengths) / len(lengths) if lengths else 0.0


def truncate(new: list[int], stop_ids: set[int], room: int) -> tuple[list[int], bool]:
    """Cut after the first stop token and to the room left; returns (tokens, hit a stop token)."""
    for i, t in enumerate(new[:room]):
        if t in stop_ids:
            return new[: i + 1], True
    return new[:room], False


@dataclass
class Cycle:
    block: list[int]  # exactly the ids the target verified (empty: the prefill's first token)
    accepted: int  # drafts kept
    emitted: list[int]  # tokens this cycle added to the output (after stop / length truncation)
    stages: int = 0  # drafting stages of b-1 drafts each behind this block (1: plain DFlash or a tree; 0: block size
    # 1 or a lookup draft alone)
    lookup: bool = False  # prompt lookup (lookup.py) drafted: the whole chain, or one path of a tree (lookup="tree")
    parents: list[int] | None = None  # a draft tree (tree.py): each draft's parent among the drafts, -1: the anchor


@dataclass
class Timing:
    """Seconds by phase; None where an engine does not measure that phase apart (llama.cpp, vLLM)."""

    prefill_s: float | None = 0.0
    draft_s: float | None = 0.0
    verify_s: float | None = 0.0
    other_s: float | None = 0.0
    total_s: float = 0.0
    tokens_per_s: float = 0.0

    def close(self, total_s: float, new_tokens: int) -> None:
        """Set the total; what prefill, drafting and verification do not explain is `other`."""
        self.total_s = total_s
        self.other_s = max(0.0, total_s - self.prefill_s - self.draft_s - self.verify_s)
        self.tokens_per_s = new_tokens / total_s if total_s > 0 else 0.0


@dataclass
class GenerationResult:
    """One generation on any engine: its tokens, cycles, timing and settings; what only one engine reports is in
    `extras`."""

    output_ids: list[int]
    num_prompt_tokens: int
    cycles: list[Cycle]  # empty where the engine reports no blocks (llama.cpp, vLLM): see reported_acceptance
    timing: Timing
    config: dict
    text: str = ""
    extras: dict = field(default_factory=dict)  # engine-specific fields (e.g. llama.cpp's own ms timers)
    reported_acceptance: list[int] | None = None  # per cycle, drafts accepted + 1, from an engine without cycles

    @property
    def num_new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def acceptance_lengths(self) -> list[int]:
        if self.reported_acceptance is not None:
            return self.reported_acceptance
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
        } | ({"extras": self.extras} if self.extras else {})


@dataclass(eq=False)
class Request:
    """A request's whole state: prompt and emitted tokens, resolved settings, samplers, room, caches, output, cycles
    and timing. tokens[-1] is the next anchor: emitted, not yet in the target cache."""

    tokens: list[int]  # prompt + emitted
    num_prompt_tokens: int
    settings: DecodeSettings  # resolved (decoding/settings.py)
    room: int  # tokens it may still emit: max_new_tokens, capped by the context
    gen: torch.Generator  # the target's sampler (seed), apart from the drafter's so a seed gives one output
    key: object = None  # the caller's handle (a prompt index, a server job)
    draft_gen: torch.Generator | None = None  # the drafter's sampler (seed + 1)
    proposer: object = None  # its own proposer (DLoop, a custom one), which drafts for it alone
    trees: bool = False  # it drafts trees (set at join: greedy, the drafter's proposals, a cache that compacts paths)
    target_cache: DynamicCache | None = None  # its own target K/V: while prefilled, and while it decodes alone
    position: int = 0  # committed positions (in the target cache)
    prefilled: int = 0  # prompt tokens through the target so far
    draft_cache: ContextCache = field(default_factory=ContextCache)
    # committed positions not yet in draft_cache, [n_i, F] a piece, joined when taken (joining them every cycle
    # copied all of them every cycle: quadratic in a plain stretch)
    pending_features: list[torch.Tensor] = field(default_factory=list)
    stopped: bool = False
    error: Exception | None = None  # what it raised in a cycle: it left the batch, the others went on
    output: list[int] = field(default_factory=list)
    cycles: list[Cycle] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    timing: Timing = field(default_factory=Timing)
    t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.end = self.num_prompt_tokens + self.room  # positions < end may be verified (the official max_length)
        self.stop_ids = set(self.settings.stop_token_ids)

    @classmethod
    def open(cls, prompt_ids: list[int], settings: DecodeSettings, context: int, key: object = None,
             device: torch.device | str = "cpu") -> Request:
        """A request for prompt_ids under resolved settings, with context positions in all; samplers on device."""
        room = min(settings.max_new_tokens, context - len(prompt_ids))
        gen, draft_gen = (torch.Generator(device=device).manual_seed(settings.seed + i) for i in (0, 1))
        return cls(list(prompt_ids), len(prompt_ids), settings, room, gen, key, draft_gen)

    @property
    def committed(self) -> int:
        return self.position

    @property
    def done(self) -> bool:
        return self.stopped or self.room <= 0 or self.error is not None

    @property
    def pending(self) -> int:
        """Committed positions whose features the drafter has not taken yet."""
        return sum(f.shape[0] for f in self.pending_features)

    def take_pending(self) -> torch.Tensor:
        """[n, F]: the features of every committed position the drafter has not seen, oldest first."""
        feats, self.pending_features = self.pending_features, []
        return feats[0] if len(feats) == 1 else torch.cat(feats, 0)

    def add_pending(self, feats: torch.Tensor) -> None:
        if self.settings.block_size > 1:  # a request of block size 1 never drafts: nothing would take them
            self.pending_features.append(feats)

    def settle(self, proposed: list[int]) -> list[int]:
        """What a cycle emits of the tokens it produced: cut after the first stop token and to the room left."""
        new, self.stopped = truncate(proposed, self.stop_ids, self.room)
        return new

    def emit(self, cycle: Cycle) -> Cycle:
        """Take a cycle's emitted tokens (the last becomes the next anchor); a verify joins the cycles."""
        self.tokens.extend(cycle.emitted)
        self.output.extend(cycle.emitted)
        self.room -= len(cycle.emitted)
        if cycle.block:
            self.cycles.append(cycle)
        return cycle

    def result(self, config: dict) -> GenerationResult:
        """The request's record, with config the settings it ran with."""
        self.timing.close(time.perf_counter() - self.t0, len(self.output))
        return GenerationResult(self.output, self.num_prompt_tokens, self.cycles, self.timing, config)
