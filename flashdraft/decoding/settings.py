"""Every decode setting in one place: its default (written once), its checks and its command-line flag."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace
from functools import cached_property

from ..errors import FlashdraftError
from ..sampling_params import SamplingParams

PREFILL_CHUNK = 256  # prompt tokens per prefill pass: a long prompt costs the batch one chunk per cycle while it joins

# Nodes per drafter cycle by default: with the anchor a tree verifies 8 rows, as a prompt-lookup cycle does. Chosen on
# the dev split; on a 2-core Xeon with the default drafter it raised τ by 9-21% and speed by 2-11% over the block-4
# chain (docs/how-it-works.md, "Draft trees").
DEFAULT_TREE = 7
LOOKUP_MODES: dict[str, bool | str] = {"on": True, "off": False, "tree": "tree"}


@dataclass(frozen=True)
class DecodeSettings:
    """How one generation decodes. None means "decide from the drafter / target" (see `resolve`)."""

    block_size: int | None = None  # tokens verified per cycle; None: the drafter's block_size (1 without one)
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy (so is anything below sampling.MIN_TEMPERATURE)
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's EOS ids
    lookup: bool | str = True  # prompt lookup (lookup.py); "tree": grafted onto the drafter's tree at T = 0
    tree: int | None = None  # draft-tree nodes per drafter cycle at T = 0; None: DEFAULT_TREE (0 under DLoop)
    loop_stages: int = 1  # DLoop drafting stages per cycle (1 = plain DFlash)
    loop_gate: float = -0.75  # DLoop: another stage only while the last stage's summed draft log-prob exceeds this

    def __post_init__(self) -> None:
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @cached_property  # read several times per row per cycle; the settings are frozen
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @cached_property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def validate(self) -> DecodeSettings:
        """One-line FlashdraftErrors for settings that cannot work; returns self."""
        if self.block_size is not None and self.block_size < 1:
            raise FlashdraftError(f"block size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise FlashdraftError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.sampling  # noqa: B018 - SamplingParams checks temperature, top-k and top-p
        if self.lookup not in (True, False, "tree"):
            raise FlashdraftError(f"lookup must be True, False or 'tree', got {self.lookup!r}")
        if not isinstance(self.loop_stages, int) or self.loop_stages < 1:
            raise FlashdraftError(f"loop stages must be an integer >= 1 (1 = plain DFlash, no looping), got "
                                  f"{self.loop_stages}")
        if not isinstance(self.loop_gate, (int, float)) or math.isnan(self.loop_gate):
            raise FlashdraftError(f"loop gate must be a number (a log-probability such as -0.75), got {self.loop_gate}")
        if self.tree is not None:
            if not isinstance(self.tree, int) or self.tree < 0:
                raise FlashdraftError(f"tree must be a node count >= 0 (0 verifies the drafter's chain), got {self.tree}")
            if self.tree and self.loop_stages > 1:
                raise FlashdraftError("a draft tree and DLoop stages do not combine; use tree=0 or loop_stages=1")
        return self

    def resolve(self, drafter_block_size: int | None, stop_token_ids: list[int] | None = None,
                own_proposer: bool = True) -> DecodeSettings:
        """Checked settings with every None decided: the block size from the drafter (1 without one), the tree
        default (DEFAULT_TREE, 0 under DLoop or with a custom proposer), stop ids from the target."""
        self.validate()
        if self.tree and not own_proposer:
            raise FlashdraftError("tree drafts come from the drafter itself; drop `propose` or use tree=0")
        block = self.block_size if self.block_size is not None else (drafter_block_size or 1)
        tree = self.tree if self.tree is not None else (DEFAULT_TREE if self.loop_stages == 1 and own_proposer else 0)
        stops = self.stop_token_ids if self.stop_token_ids is not None else tuple(stop_token_ids or ())
        return replace(self, block_size=block, tree=tree, stop_token_ids=stops)

    def updated(self, **changes) -> DecodeSettings:
        """A copy with some fields changed (unknown names are an error)."""
        names = {f.name for f in fields(self)}
        bad = sorted(set(changes) - names)
        if bad:
            raise TypeError(f"unknown decode settings {bad}; known: {sorted(names)}")
        return replace(self, **changes)

    def record(self, trees: bool) -> dict:
        """The `config` of a generation's record (docs/design.md §7), for resolved settings; trees: whether draft
        trees actually ran (greedy, a cache that can compact a path)."""
        return {"block_size": self.block_size, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "loop_stages": self.loop_stages, "loop_gate": self.loop_gate,
                "lookup": self.lookup if self.block_size > 1 else False, "tree": self.tree if trees else 0}


DEFAULTS = DecodeSettings()


def settings_from(settings: DecodeSettings | None = None, **overrides) -> DecodeSettings:
    """The Python API's keyword arguments (the setting names) on top of `settings` (default: the defaults)."""
    base = settings or DEFAULTS
    return base.updated(**overrides) if overrides else base


# ---------------------------------------------------------------- command line

def parse_list(text: str, what: str, kind: type) -> list:
    """'1,2,3' → [1, 2, 3]; a one-line error naming the option otherwise."""
    try:
        values = [kind(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FlashdraftError(f"{what} must be comma-separated {kind.__name__} values, got {text!r}") from None
    if not values:
        raise FlashdraftError(f"{what} is empty; give comma-separated values such as 1,2,3")
    return values


def parse_ids(text: str, what: str) -> list[int]:
    """'1, 2,3' → [1, 2, 3] (token ids)."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FlashdraftError(f"{what} must be comma-separated integers, got {text!r}") from None


def parse_lookup(text: str) -> list[bool | str]:
    """--lookup 'on', 'off', 'tree' or a comma list of them → [True], [False], ['tree'], e.g. [True, 'tree']."""
    values = parse_list(text, "--lookup", str)
    if any(v not in LOOKUP_MODES for v in values):
        raise FlashdraftError(f"--lookup takes on, off, tree or a comma list of them (e.g. on,off); got {text!r}")
    return [LOOKUP_MODES[v] for v in dict.fromkeys(values)]




def add_decode_arguments(p: argparse.ArgumentParser, *, sweep: bool = False, per_request: bool = True) -> None:
    """The decode flags, spelled the same in every command.

    sweep (bench): --block-size repeats and --lookup/--tree/--loop-stages/--loop-gate take comma lists.
    per_request=False (serve): only the engine-wide settings; length, sampling and stops come with each request.
    """
    d = DEFAULTS
    many = " (comma-separated to sweep)" if sweep else ""
    if sweep:
        p.add_argument("--block-size", type=int, action="append",
                       help="tokens verified per cycle (repeatable to sweep; default: the drafter's block_size)")
    else:
        p.add_argument("--block-size", type=int,
                       help="tokens verified per cycle (default: the drafter's block_size; 1 = plain decoding)")
    if per_request:
        p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
        p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default)")
        p.add_argument("--top-p", type=float, default=d.top_p)
        p.add_argument("--top-k", type=int, default=d.top_k, help="0 disables top-k")
        p.add_argument("--seed", type=int, default=d.seed)
        p.add_argument("--stop-token-ids", help="comma-separated stop ids (default: the target's EOS ids)")
    p.add_argument("--lookup", default=None if not sweep else "on",
                   help="prompt lookup: on (default: where the text's last n-gram recurs, verify what followed it "
                        "instead of drafting), off, or tree (at temperature 0, verify it as one more path of the "
                        f"drafter's tree){many}")
    if not sweep:  # the older spellings of --lookup off / --lookup tree
        p.add_argument("--no-lookup", action="store_true", help="the same as --lookup off")
        p.add_argument("--lookup-tree", action="store_true", help="the same as --lookup tree")
    p.add_argument("--tree", type=None if sweep else int,
                   help="at temperature 0, verify a tree of this many drafted nodes per drafter cycle instead of the "
                        f"drafter's chain (default {DEFAULT_TREE}, 0 with DLoop; 0 = the chain){many}")
    p.add_argument("--loop-stages", type=None if sweep else int, default=str(d.loop_stages) if sweep else d.loop_stages,
                   help="DLoop: up to S drafting stages per cycle, each continuing after the previous stage's "
                        f"unverified drafts; verified in one pass (default 1 = plain DFlash){many}")
    p.add_argument("--loop-gate", type=None if sweep else float, default=f"{d.loop_gate:g}" if sweep else d.loop_gate,
                   help="DLoop: draft another stage only while the last stage's summed draft log-probability exceeds "
                        f"this (default {d.loop_gate:g}; lower = more stages){many}")


def lookup_from_args(args) -> bool | str:
    """--lookup, or its older spellings --no-lookup / --lookup-tree (not both ways at once)."""
    old = [f for f, on in (("--no-lookup", getattr(args, "no_lookup", False)),
                           ("--lookup-tree", getattr(args, "lookup_tree", False))) if on]
    if len(old) > 1:
        raise FlashdraftError("--no-lookup and --lookup-tree contradict each other; pass one")
    if old and args.lookup is not None:
        raise FlashdraftError(f"{old[0]} and --lookup say the same thing twice; pass one")
    if old:
        return False if old[0] == "--no-lookup" else "tree"
    if args.lookup is None:
        return DEFAULTS.lookup
    values = parse_lookup(args.lookup)
    if len(values) > 1:
        raise FlashdraftError(f"--lookup takes one of on, off, tree here, got {args.lookup!r}")
    return values[0]


def lookup_flag(args) -> str | None:
    """The lookup flag that was passed (--no-lookup, --lookup-tree or --lookup), or None: engines that cannot look up
    name it when they refuse it."""
    for flag, on in (("--no-lookup", getattr(args, "no_lookup", False)),
                     ("--lookup-tree", getattr(args, "lookup_tree", False)), ("--lookup", args.lookup is not None)):
        if on:
            return flag
    return None


def settings_from_args(args) -> DecodeSettings:
    """The checked settings of a command (not bench's sweep) from its parsed flags."""
    stops = getattr(args, "stop_token_ids", None)
    kw = dict(block_size=args.block_size, lookup=lookup_from_args(args), tree=args.tree,
              loop_stages=args.loop_stages, loop_gate=args.loop_gate)
    if hasattr(args, "max_new_tokens"):
        kw |= dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed,
                   stop_token_ids=parse_ids(stops, "--stop-token-ids") if stops is not None else None)
    return DecodeSettings(**kw).validate()
