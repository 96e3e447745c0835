"""The DFlash generation cycle (DESIGN.md §1): prefill, draft, verify, accept, commit / roll back.

Drafting is a proposer: plain DFlash drafts one block per cycle (`drafter_proposer`); DLoop (dloop.py) may run the
drafter several stages per cycle. Either way the target verifies whatever was proposed in one forward pass.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from . import target as T
from .dflash2 import selector_children, top_children
from .drafter import ContextCache, draft_hidden, proposal_logits
from .errors import FlashdraftError
from .lookup import LOOKUP_BLOCK, lookup_drafts, one_hot_q
from .sampling import SamplingParams, accept_greedy, accept_sampling, process, sample
from .tree import TREE_WIDTH, accept_tree_greedy, best_first_tree, graft_chain, node_depths, resolve_tree


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
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def lookup_cycles(self) -> int:
        """Cycles that verified a prompt-lookup draft (alone, or as one path of the drafter's tree)."""
        return sum(c.lookup for c in self.cycles)

    @property
    def mean_stages(self) -> float:
        """Mean drafting stages per cycle (1.0 for plain DFlash; above 1 when DLoop drafted further stages)."""
        return sum(c.stages for c in self.cycles) / len(self.cycles) if self.cycles else 0.0

    def to_record(self) -> dict:
        """The machine-readable record of DESIGN.md §7."""
        return {
            "output_ids": self.output_ids, "text": self.text, "num_prompt_tokens": self.num_prompt_tokens,
            "num_new_tokens": self.num_new_tokens, "acceptance_lengths": self.acceptance_lengths,
            "cycles": [{"block": c.block, "accepted": c.accepted, "stages": c.stages, "lookup": c.lookup,
                        "parents": c.parents}
                       for c in self.cycles],
            "timing": asdict(self.timing), "config": self.config,
        }


# propose(state, start, b) -> (drafts [k], q [k, V] or None at temperature 0); k is usually b-1 (one stage), and
# DLoop proposes whole multiples of b-1 (one per stage). The decode loop verifies any k with start + 1 + k <= state.end.
Proposer = Callable[[DecodeState, int, int], tuple[torch.Tensor, torch.Tensor | None]]

# stage(cache, new_features [1, n, F], inputs, start, n) -> (drafts [n], q [n, V] or None, raw drafter logits [n, V])
StageDrafter = Callable[[ContextCache, torch.Tensor, list[int], int, int],
                        tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]

# propose_tree(state, start, b) -> (node tokens [N], parents [N]): a draft tree at most b-1 deep (tree.py), greedy only
TreeProposer = Callable[[DecodeState, int, int], tuple[torch.Tensor, list[int]]]


def drafter_pass(model: PreTrainedModel, drafter: torch.nn.Module) -> Callable[
        [ContextCache, torch.Tensor, list[int], int, int], tuple[torch.Tensor, torch.Tensor]]:
    """pass(cache, new_features, inputs, start, n): one drafter pass over [inputs..., M x n] at positions start..
    → (final hidden states [len(inputs) + n, H], proposal logits [n, V] of the last n block positions)."""
    embed, head, mask_id = T.embed(model), T.lm_head(model), drafter.config.mask_token_id
    dtype = next(drafter.parameters()).dtype

    def run(cache: ContextCache, new_features: torch.Tensor, inputs: list[int], start: int, n: int):
        block = torch.tensor(inputs + [mask_id] * n, device=model.device)
        hidden = draft_hidden(drafter, cache, new_features, embed(block)[None].to(dtype), start)
        return hidden, proposal_logits(drafter, hidden, head, n)

    return run


def stage_drafter(model: PreTrainedModel, drafter: torch.nn.Module, params: SamplingParams,
                  gen: torch.Generator | None) -> StageDrafter:
    """One drafter pass over [inputs..., M x n] at positions start..: n drafts from the last n block positions."""
    run = drafter_pass(model, drafter)
    selector = getattr(drafter, "candidate_selector", None)

    def draft(cache: ContextCache, new_features: torch.Tensor, inputs: list[int], start: int, n: int):
        hidden, logits = run(cache, new_features, inputs, start, n)
        if selector is not None:  # DFlash 2: walk the candidate paths from the last input; q is the selector's softmax
            drafts, q = selector.walk(hidden[-n:], logits, inputs[-1], params.temperature, gen)
        elif params.greedy:
            drafts, q = logits.argmax(-1), None
        else:
            q = process(logits, params)
            drafts = sample(q, gen)
        return drafts, q, logits

    return draft


def drafter_proposer(model: PreTrainedModel, drafter: torch.nn.Module, params: SamplingParams,
                     gen: torch.Generator | None) -> Proposer:
    """Draft b-1 tokens in one drafter pass: argmax at T=0, else sampled from the processed q (DFlash 2: path walk)."""
    draft = stage_drafter(model, drafter, params, gen)

    def propose(state: DecodeState, start: int, b: int):
        drafts, q, _ = draft(state.draft_cache, state.take_pending()[None], [state.tokens[-1]], start, b - 1)
        return drafts, q

    return propose


def tree_proposer(model: PreTrainedModel, drafter: torch.nn.Module, budget: int,
                  width: int = TREE_WIDTH) -> TreeProposer:
    """One drafter pass, then the `budget` likeliest nodes of its continuations (tree.py), at most b-1 deep."""
    run = drafter_pass(model, drafter)
    selector = getattr(drafter, "candidate_selector", None)

    def propose(state: DecodeState, start: int, b: int):
        anchor = state.tokens[-1]
        hidden, logits = run(state.draft_cache, state.take_pending()[None], [anchor], start, b - 1)
        children = (selector_children(selector, hidden[-(b - 1):], logits, width) if selector is not None
                    else top_children(logits, width))
        tokens, parents = best_first_tree(children, anchor, b - 1, budget)
        return torch.tensor(tokens, dtype=torch.long, device=model.device), parents

    return propose


def trees_apply(params: SamplingParams, cache: DynamicCache) -> bool:
    """Whether decode verifies drafter trees: greedy only, on a cache whose verified rows can be compacted."""
    return params.greedy and T.supports_tree(cache)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _truncate(new: list[int], stop_ids: set[int], room: int) -> tuple[list[int], bool]:
    """Cut after the first stop token and to the room left; returns (tokens, hit a stop token)."""
    for i, t in enumerate(new[:room]):
        if t in stop_ids:
            return new[: i + 1], True
    return new[:room], False


def check_args(block_size: int, max_new_tokens: int) -> None:
    if block_size < 1:
        raise FlashdraftError(f"block size must be >= 1, got {block_size}")
    if max_new_tokens < 1:
        raise FlashdraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.inference_mode()
def decode(model: PreTrainedModel, prompt_ids: list[int], *, block_size: int, max_new_tokens: int,
           params: SamplingParams, layer_ids: list[int], propose: Proposer | None, seed: int = 0,
           stop_token_ids: list[int] | tuple = (), timing: Timing | None = None,
           state_hook: Callable[[DecodeState], None] | None = None, lookup: bool | str = False,
           propose_tree: TreeProposer | None = None) -> Iterator[Cycle]:
    """Yield one Cycle per target verify; the prefill's first token comes as a Cycle with an empty block.

    lookup: where the context's last n-gram recurs, verify the tokens that followed it (prompt lookup, lookup.py) as
    the whole draft instead of calling `propose`; "tree": as one more root path of the drafter's tree where trees run
    (elsewhere as True).
    propose_tree: at temperature 0, draft a tree (tree.py) instead of calling `propose` (a chain), where the target's
    cache can compact a verified path (every layer full attention); elsewhere `propose` drafts as usual.
    """
    check_args(block_size, max_new_tokens)
    if lookup not in (True, False, "tree"):
        raise FlashdraftError(f"lookup must be True, False or 'tree', got {lookup!r}")
    T.check_prompt(model, prompt_ids)
    if block_size > 1 and propose is None:
        raise FlashdraftError("block size > 1 needs a drafter; pass one or use block size 1")
    timing = timing if timing is not None else Timing()
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    room = min(max_new_tokens, T.context_limit(model) - len(prompt_ids))
    stop = set(stop_token_ids)

    def pick(logits: torch.Tensor) -> int:
        return int(logits.argmax(-1)) if params.greedy else int(sample(process(logits, params), gen))

    t0 = _now(dev)
    state = DecodeState(list(prompt_ids), len(prompt_ids), T.new_cache(model), len(prompt_ids) + room)
    if not trees_apply(params, state.target_cache):
        propose_tree = None
    out = T.forward(model, torch.tensor(prompt_ids, device=dev), 0, state.target_cache, layer_ids, logits_to_keep=1)
    first = pick(out.logits[-1])
    if layer_ids:
        state.add_pending(out.features)
    state.tokens.append(first)
    timing.prefill_s = _now(dev) - t0
    new, stopped = _truncate([first], stop, room)
    room -= len(new)
    if state_hook:
        state_hook(state)
    yield Cycle([], 0, new)

    # As the official loop: cycle while tokens are still owed, and verify at most as many positions as could still
    # be emitted (verify_size = min(block_size, max_length - start)), so the last blocks shrink instead of verifying
    # tokens that would be cut off.
    while not stopped and room > 0:
        start = state.committed  # position of the anchor
        b = min(block_size, state.end - start)
        t1 = _now(dev)
        k = min(max(b, LOOKUP_BLOCK), state.end - start) - 1  # a lookup draft may run past a small drafter block
        look = lookup_drafts(state.tokens, k) if lookup and b > 1 else []
        parents = None  # a chain; else the drafts are a tree's nodes
        if b > 1 and propose_tree is not None and (lookup == "tree" or not look):
            (drafts, parents), q = propose_tree(state, start, b), None
            if look:  # lookup="tree": the lookup draft becomes one more root path of the drafter's tree
                nodes, parents = graft_chain(drafts.tolist(), parents, look)
                drafts = torch.tensor(nodes, dtype=torch.long, device=dev)
        elif look:
            drafts, q = torch.tensor(look, device=dev), None
        elif b > 1:
            drafts, q = propose(state, start, b)
        else:
            drafts, q = torch.zeros(0, dtype=torch.long, device=dev), None
        t2 = _now(dev)
        span = len(drafts) if parents is None else max(node_depths(parents), default=0)
        if start + 1 + span > state.end:
            raise RuntimeError(f"the proposer drafted {span} tokens deep at {start}, past the end {state.end}")
        block = torch.cat([torch.tensor([state.tokens[-1]], device=dev), drafts])
        out = T.forward(model, block, start, state.target_cache, layer_ids, parents=parents)
        t3 = _now(dev)
        path = None  # the accepted nodes of a tree
        if parents is not None:
            path, nxt = accept_tree_greedy(drafts.tolist(), parents, out.logits.argmax(-1).tolist())
            n_acc = len(path)
        elif params.greedy:
            n_acc, nxt = accept_greedy(drafts, out.logits.argmax(-1))
        else:
            if look:  # a deterministic draft: q is one-hot, so each draft is kept with the target's probability of it
                q = one_hot_q(drafts, out.logits.shape[-1])
            n_acc, nxt = accept_sampling(drafts, q if q is not None else out.logits[:0], process(out.logits, params), gen)
        kept = drafts[path].tolist() if path is not None else drafts[:n_acc].tolist()
        new, stopped = _truncate(kept + [nxt], stop, room)
        # commit the anchor and the drafts that were emitted; the last emitted token is the next anchor
        rows = [0] + [i + 1 for i in path] if path is not None else list(range(n_acc + 1))
        rows = rows[: len(new)]
        T.keep_rows(state.target_cache, start, rows)
        if layer_ids:
            state.add_pending(out.features[rows])
        room -= len(new)
        state.tokens.extend(new)
        timing.draft_s += t2 - t1
        timing.verify_s += t3 - t2
        if state_hook:
            state_hook(state)
        if path is not None:
            stages = 1  # one drafter pass behind a tree
        else:  # DLoop stages each add b-1 drafts; none behind a lookup draft or a one-token block
            stages = -(-len(drafts) // (b - 1)) if b > 1 and not look else 0
        yield Cycle(block.tolist(), n_acc, new, stages, bool(look), parents)


def drafter_setup(model: PreTrainedModel, drafter: torch.nn.Module | None, block_size: int, params: SamplingParams,
                  seed: int, loop_stages: int = 1, loop_gate: float = -0.75,
                  tree: int = 0) -> tuple[list[int], Proposer | None, TreeProposer | None]:
    """(target layer ids to collect, the drafter's chain proposer, its tree proposer when tree > 0) for a generation;
    ([], None, None) when decoding plainly.

    The proposer draws from its own generator (seed + 1), so the same seed gives the same output everywhere.
    """
    from .dloop import looped_proposer  # dloop builds on this module

    if drafter is None or block_size <= 1:
        return [], None, None
    gen = torch.Generator(device=model.device).manual_seed(seed + 1)
    propose = (drafter_proposer(model, drafter, params, gen) if loop_stages == 1
               else looped_proposer(model, drafter, params, gen, loop_stages, loop_gate))
    return list(drafter.config.target_layer_ids), propose, tree_proposer(model, drafter, tree) if tree else None


def generate_ids(model: PreTrainedModel, drafter: torch.nn.Module | None, prompt_ids: list[int], *,
                 block_size: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_token_ids: list[int] | tuple = (),
                 on_tokens: Callable[[list[int]], None] | None = None,
                 state_hook: Callable[[DecodeState], None] | None = None,
                 propose: Proposer | None = None, loop_stages: int = 1, loop_gate: float = -0.75,
                 lookup: bool | str = True, tree: int | None = None) -> GenerationResult:
    """Speculative decoding of prompt_ids with drafter (None and block size 1: plain autoregressive).

    lookup (True by default): where the context's last n-gram recurs, verify the tokens that followed it instead of
    running the drafter (prompt lookup, lookup.py); lossless like any draft. "tree": at temperature 0 verify them as
    one more path of the drafter's tree instead, which keeps the longer of the two (more τ, more verify rows and a
    drafter pass every cycle). False: every cycle is the drafter's.

    tree: at temperature 0, each drafter cycle verifies a tree of that many drafted nodes (tree.py) instead of the
    drafter's b-1 chain; 0 verifies the chain. None: DEFAULT_TREE with the drafter's own one-stage proposer, else 0.

    loop_stages > 1 turns on DLoop (dloop.py): after each drafting stage whose summed draft log-probability exceeds
    loop_gate, the drafter drafts another b-1 tokens after the unverified ones, up to loop_stages stages per cycle.
    """
    from .dloop import check_loop  # dloop builds on this module

    params = SamplingParams(temperature, top_k, top_p)
    check_loop(loop_stages, loop_gate)
    if loop_stages > 1 and propose is not None:
        raise FlashdraftError("loop_stages applies to the drafter's own proposer; drop it or loop inside `propose`")
    tree = resolve_tree(tree, loop_stages, own_proposer=propose is None)
    if block_size is None:
        block_size = drafter.config.block_size if drafter is not None else 1
    layer_ids, own, propose_tree = drafter_setup(model, drafter, block_size, params, seed, loop_stages, loop_gate,
                                                 tree)
    propose = propose or own
    timing = Timing()
    t0 = time.perf_counter()
    cycles, output = [], []
    for cycle in decode(model, prompt_ids, block_size=block_size, max_new_tokens=max_new_tokens, params=params,
                        layer_ids=layer_ids, propose=propose, seed=seed, stop_token_ids=stop_token_ids,
                        timing=timing, state_hook=state_hook, lookup=lookup, propose_tree=propose_tree):
        output.extend(cycle.emitted)
        if cycle.block:
            cycles.append(cycle)
        if on_tokens and cycle.emitted:
            on_tokens(cycle.emitted)
    timing.total_s = time.perf_counter() - t0
    timing.other_s = max(0.0, timing.total_s - timing.prefill_s - timing.draft_s - timing.verify_s)
    timing.tokens_per_s = len(output) / timing.total_s if timing.total_s > 0 else 0.0
    config = {"block_size": block_size, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
              "loop_stages": loop_stages, "loop_gate": loop_gate, "lookup": lookup if block_size > 1 else False,
              "tree": tree if propose_tree and trees_apply(params, T.new_cache(model)) else 0}
    return GenerationResult(output, len(prompt_ids), cycles, timing, config)
