"""Load-adaptive speculation (docs/adaptive.md): each cycle, the verify width of each sequence that maximises the
batch's expected tokens per second, from pass costs measured online and each request's running acceptance.

Costs: per batch size N (the shape the machine sees now), the part of a cycle that is not drafting (the padded
verify of N rows, acceptance and commits) at padded width w, t_v(w); and, for every batch size alike (a drafter pass
over D rows is the same work whatever the batch), drafting while D rows speculate, t_d(D) (those drafted by prompt
lookup included: the plan cannot know which rows will skip the drafter): each amount measured is the running mean of
its own recent measurements (exponential forgetting), so it follows the machine as it is now (another process taking
the cores shows up within a few cycles); an amount not measured yet is read off the line a + c·x through the
measured ones. Acceptance: each request's drafts are kept with a running rate α (drafts kept / drafts kept + first
rejections, from a prior: the pooled rate of the requests before it), so a width-w block yields E(w) = 1 + α + … +
α^(w−1) tokens, its gain E − 1 scaled by what the request's speculating cycles have gained against that estimate
at today's α (from the pool's as its prior: a tree, more so one grafted deeper by prompt lookup, gains more than its
chain's E). The policy scans the widths, lets the rows whose expected gain does not pay for their drafter share
decode plainly, and keeps the best Σ E / (t_v + t_d); it turns speculation on or off only for a gain above
SWITCH_MARGIN. Each batch size keeps its own costs, plan and tries; one met first starts as the nearest measured
size decided, planning on that size's costs scaled to its own first cycle.
Now and then it tries the other choice instead (plain while speculating, every row's widest speculation while not:
what the plan weighs), so a wrong choice is measured and undone: first after EXPLORE cycles, then, each time the
plan stays as it was, after twice as many (and at least as many as keep the tries' expected cost under TRY_TAX of
the time; up to EXPLORE_MAX), so that a clear choice is not taxed by re-checking it; a change of plan starts over at
EXPLORE. While it decodes plainly, a request with fewer than MEASURE_NEW cycles of its own measured brings the next
try forward to the earliest the TRY_TAX spacing allows: a new request's prior is the rate of the requests before it,
which may be another workload's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

HALF_LIFE = 24  # observations: how quickly measured costs forget (contention changes are seen within ~a dozen)
EXPLORE = 8  # cycles before the other choice is tried (plain if speculating, the widest speculation if not) …
EXPLORE_MAX = 128  # … doubling, while the plan does not change, up to this many
TRY_TAX = 0.01  # … and at least as many as keep the expected cost of tries under this share of the time
PRIOR_KEPT, PRIOR_TRIED = 1.0, 2.0  # α starts at 0.5 and moves with each request's own cycles …
PRIOR_POOLED = 8.0  # … or, in a decoder, at the rate of the requests before it, worth this many drafts
POOL_HALF_LIFE = 64  # rows' cycles: how quickly the pool of all requests' cycles (a new request's prior) forgets
SWITCH_MARGIN = 0.05  # the plan turns speculation on or off only for an expected gain of more than this
MEASURE_NEW = 3  # while the batch decodes plainly, a request with fewer cycles of its own measured calls for a try
CLOSE = 0.10  # choices expected within this of each other are a close call: the other one is tried every EXPLORE cycles
PRIOR_GAIN = 8.0  # a request's gain over the chain model starts at the pool's, worth this many expected tokens gained


class CostModel:
    """Seconds for an amount of work x: for each amount measured, the mean of its measurements with exponential
    forgetting (every observation of any amount ages them all); for an amount not measured, the line a + c·x through
    those means (least squares weighted by their recency). Each amount follows its own measurements, so one measured
    rarely (plain decoding while speculating: only at its tries) is its latest measurements, never a line outvoted by
    the stale measurements of another (a contended spell's, after it ended)."""

    def __init__(self, half_life: float = HALF_LIFE):
        self.decay = 0.5 ** (1 / half_life)
        self.means: dict[float, float] = {}
        self.weights: dict[float, float] = {}  # per amount: the summed weight of its measurements

    def observe(self, x: float, t: float) -> None:
        for k in self.weights:
            self.weights[k] *= self.decay
        w = self.weights.get(x, 0.0) + 1
        m = self.means.get(x, t)
        self.means[x], self.weights[x] = m + (t - m) / w, w

    @property
    def amounts(self) -> set[float]:
        """The amounts of work measured (a line needs two)."""
        return set(self.means)

    @property
    def seen(self) -> bool:
        return bool(self.means)

    def predict(self, x: float) -> float:
        """Seconds for work x: its own mean if measured; else the line, proportional until two amounts were
        measured, never negative."""
        if x in self.means:
            return self.means[x]
        if not self.means:
            return 0.0
        w = sum(self.weights.values())
        sx = sum(self.weights[k] * k for k in self.means)
        sy = sum(self.weights[k] * m for k, m in self.means.items())
        sxx = sum(self.weights[k] * k * k for k in self.means)
        sxy = sum(self.weights[k] * k * m for k, m in self.means.items())
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(w * sxx, 1e-12):
            return sy / sx * x if sx > 0 else sy / w
        c = (w * sxy - sx * sy) / var
        a = (sy - c * sx) / w
        if c < 0 or a < 0:  # noise: fall back to the cheaper-to-trust one-parameter fits
            return max(sy / w, 0.0) if c < 0 else sy / sx * x
        return a + c * x


@dataclass
class Acceptance:
    """A request's running draft acceptance: drafts kept, and cycles that ended in a rejection; and the tokens its
    speculating cycles gained beyond one, against what the chain model expects of them at the rate it has now (a
    tree, and lookup grafted onto it, keep more than the chain of its depth: in logged runs gsm8k requests gained
    1.03–1.15× that). With decay < 1 the counts forget (the pool of all requests' cycles, which seeds a new
    request's priors)."""

    kept: float = PRIOR_KEPT
    rejected: float = PRIOR_TRIED - PRIOR_KEPT
    gained: float = PRIOR_GAIN  # tokens beyond one its speculating cycles emitted, after PRIOR_GAIN × the prior scale
    spec_widths: dict[int, float] = field(default_factory=dict)  # its speculating cycles by chain width
    prior: float = PRIOR_GAIN  # the expected tokens that the prior scale is worth
    decay: float = 1.0
    pool: Acceptance | None = field(default=None, repr=False)  # told every observation too
    cycles: int = 0  # its own cycles with drafts

    @classmethod
    def seeded(cls, pool: Acceptance) -> Acceptance:
        """A new request's acceptance: the pool's rate and gain as its priors (a request is most likely like the
        ones before it; starting from 1/2 kept a good drafter's requests decoding plainly until a try measured them)."""
        return cls(PRIOR_POOLED * pool.rate, PRIOR_POOLED * (1 - pool.rate), PRIOR_GAIN * pool.scale, pool=pool)

    def observe(self, drafts: int, accepted: int) -> None:
        if drafts:
            self.cycles += 1
            self.kept = self.kept * self.decay + accepted
            self.rejected = self.rejected * self.decay + (accepted < drafts)
            if self.pool is not None:
                self.pool.observe(drafts, accepted)

    def observe_gain(self, width: int, gained: float) -> None:
        """A speculating cycle: its chain width (what Row.chain_width gives) and the tokens beyond one it emitted."""
        if self.decay < 1:
            self.spec_widths = {w: n * self.decay for w, n in self.spec_widths.items()}
            self.prior *= self.decay
        self.spec_widths[width] = self.spec_widths.get(width, 0.0) + 1
        self.gained = self.gained * self.decay + gained
        if self.pool is not None:
            self.pool.observe_gain(width, gained)

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)

    @property
    def scale(self) -> float:
        """Tokens gained over what the chain model expects of the same cycles at today's rate (bounded to 0.5–2).

        Today's rate, not each cycle's own: a request starts at the pool's rate, and a chat request after gsm8k
        ones started at α 0.68 and settled at 0.39; priced by the cycles' own rates, its early cycles had expected
        far more than came, its scale fell to 0.67 where its gains matched the chain model's, and it decoded plainly
        for 75 cycles at 0.85× speculation's rate."""
        expected = self.prior + sum(n * (self.expected_tokens(w) - 1) for w, n in self.spec_widths.items())
        return min(max(self.gained / max(expected, 1e-9), 0.5), 2.0)

    def expected_tokens(self, width: int) -> float:
        """Tokens a cycle emits verifying `width` positions (the anchor and width − 1 drafts)."""
        a = min(self.rate, 0.999)
        return (1 - a ** width) / (1 - a)


def pooled_acceptance() -> Acceptance:
    """The acceptance of every request's cycles, recent ones weighing most: the priors of the next request."""
    return Acceptance(decay=0.5 ** (1 / POOL_HALF_LIFE))


@dataclass
class Row:
    """What the policy knows of one sequence this cycle."""

    acceptance: Acceptance
    max_width: int  # its own block (or tree rows), capped by the tokens it is still owed
    span: int | None = None  # a tree: the most tokens a cycle can emit (its depth + 1); it verifies all its rows or none

    def width(self, w: int) -> int:
        """Its verify width in a batch of width w: a tree whole or not at all, a chain its first w positions."""
        if self.span is not None:
            return self.max_width if w > 1 else 1
        return min(w, self.max_width)

    def chain_width(self, width: int) -> int:
        """The chain the model prices a cycle at `width` as: a tree's by its span (its depth + 1)."""
        return width if self.span is None or width == 1 else self.span

    def expected_tokens(self, width: int) -> float:
        """The chain model's tokens for a cycle at `width` (what the request's gain is measured against)."""
        return self.acceptance.expected_tokens(self.chain_width(width))

    @cached_property
    def scale(self) -> float:
        """The request's gain over the chain model (once a cycle: the plan asks for it at every width)."""
        return self.acceptance.scale

    def gain(self, width: int) -> float:
        """Tokens beyond one that the plan expects of a cycle at `width`: the chain model's, scaled by what the
        request's speculating cycles gained against it."""
        return self.scale * (self.expected_tokens(width) - 1)


@dataclass
class Scaled:
    """Another batch size's verify costs times a factor: a size measured at one width only, planning on the
    nearest measured size's line scaled to agree with that one measurement."""

    model: CostModel
    factor: float

    @classmethod
    def to(cls, near: CostModel, own: CostModel) -> Scaled:
        x = next(iter(own.amounts))
        return cls(near, own.means[x] / max(near.predict(x), 1e-9))

    def predict(self, x: float) -> float:
        return self.factor * self.model.predict(x)


def cycle_cost(verify: CostModel | Scaled, draft: CostModel, width: int, drafting: int) -> float:
    """Predicted seconds of a cycle: the verify at padded width `width`, and drafting for `drafting` rows if any."""
    return verify.predict(width) + (draft.predict(drafting) if drafting else 0.0)


def plan(rows: list[Row], widths: list[int], verify: CostModel | Scaled, draft: CostModel,
         speculate: bool | None = None) -> tuple[float, list[int]]:
    """(expected tokens per second, each row's width) of the best plan over the candidate batch widths, with this
    batch size's costs: verify(padded width) and draft(drafting rows); speculate=True/False: the best plan that
    speculates / does not."""
    best = (-1.0, [1] * len(rows))
    if speculate is False:
        return len(rows) / max(verify.predict(1), 1e-9), best[1]
    for w in widths:
        own = [r.width(w) for r in rows]
        gain = [r.gain(k) for r, k in zip(rows, own)]
        spec = sorted((i for i, k in enumerate(own) if k > 1), key=lambda i: gain[i])
        while spec or speculate is None:  # rows drop out of speculation, least useful first, while that pays
            cost = cycle_cost(verify, draft, max((own[i] for i in spec), default=1), len(spec))
            rate = (len(rows) + sum(gain[i] for i in spec)) / max(cost, 1e-9)
            if rate > best[0]:
                best = (rate, [own[i] if i in spec else 1 for i in range(len(rows))])
            if not spec:
                break
            spec.pop(0)
    return best


def try_interval(rows: list[Row], chosen: list[int], verify: CostModel | Scaled, draft: CostModel) -> float:
    """Cycles between tries that keep their expected cost under TRY_TAX of the time: a try (the other choice: plain
    while `chosen` speculates, every row's widest speculation while not) costs the seconds it takes beyond what the
    chosen plan would take for the tokens it is expected to emit."""
    def seconds_tokens(widths: list[int]) -> tuple[float, float]:
        cost = cycle_cost(verify, draft, max(widths), sum(w > 1 for w in widths))
        return cost, sum(1 + r.gain(w) for r, w in zip(rows, widths))

    now_s, now_tokens = seconds_tokens(chosen)
    other = [1] * len(rows) if max(chosen) > 1 else [r.max_width for r in rows]
    try_s, try_tokens = seconds_tokens(other)
    extra = try_s - try_tokens * now_s / max(now_tokens, 1e-9)
    return max(extra, 0.0) / (TRY_TAX * max(now_s, 1e-9))


@dataclass
class BatchSize:
    """What the policy keeps for one batch size: its costs, its choice and the rhythm of its tries. Each batch size
    is its own machine (at 2 rows plain decoding may be right where at 1 speculation is): when requests come and go,
    one size's plan and tries must not reset another's."""

    verify: CostModel = field(default_factory=CostModel)  # a cycle's cost but drafting, by padded width
    cycle: int = 0  # this batch size's cycles so far
    speculating: bool = True
    interval: float = EXPLORE
    next_try: float = EXPLORE
    tried: int = 0  # the cycle of a try whose outcome the next plan judges (0: none pending)
    last_try: int = 0  # the cycle of the latest try


class AdaptivePolicy:
    """Chooses each cycle's widths from the costs measured at the current batch size; told each cycle's costs."""

    def __init__(self, max_width: int):
        self.widths = sorted({1, 2, 3, 4, 6, 8, 12, 16, max_width} & set(range(1, max_width + 1)))
        self.sizes: dict[int, BatchSize] = {}
        # drafting's cost by rows speculating, shared by the batch sizes: kept per size, one early measurement (the
        # process's first drafter pass, ~4x a warm one) priced its drafting until its next try, up to 128 cycles later
        self.draft = CostModel()

    def state(self, rows: int) -> BatchSize:
        return self.sizes.setdefault(rows, BatchSize())

    def costs(self, rows: int) -> tuple[CostModel, CostModel]:
        return self.state(rows).verify, self.draft

    def nearest(self, rows: int) -> BatchSize | None:
        """The measured batch size (costs at two widths) closest to `rows`, if any."""
        sizes = [n for n, b in self.sizes.items() if len(b.verify.amounts) >= 2]
        return self.sizes[min(sizes, key=lambda n: (abs(n - rows), n))] if sizes else None

    def choose(self, rows: list[Row]) -> list[int]:
        b = self.state(len(rows))
        b.cycle += 1
        verify, draft = b.verify, self.draft
        if len(b.verify.amounts) < 2:  # a batch size met first
            near = self.nearest(len(rows))
            if near is None:  # the first of all: measure its widest cycle, then a plain one
                return [r.max_width for r in rows] if not b.verify.seen else [1] * len(rows)
            if not b.verify.seen:  # start as the nearest measured size decided, and measure that
                b.speculating = near.speculating
                return [r.max_width for r in rows] if b.speculating else [1] * len(rows)
            # until it has measured both choices, plan on the nearest size's costs scaled to its one measurement
            # (a size met briefly, as the batch drains, would otherwise spend a cycle on the costlier choice)
            verify = Scaled.to(near.verify, b.verify)
        if b.cycle >= b.next_try:  # the choice that matters most, speculate or not, stays measured both ways
            b.tried = b.last_try = b.cycle
            b.next_try = float("inf")  # the plan of the next cycle sets the next try
            return [1] * len(rows) if b.speculating else [r.max_width for r in rows]
        spec_rate, spec_widths = plan(rows, self.widths, verify, draft, True)
        plain_rate, plain_widths = plan(rows, self.widths, verify, draft, False)
        kept, other = (spec_rate, plain_rate) if b.speculating else (plain_rate, spec_rate)
        # the expected gain of a switch must beat the noise of its estimate
        speculating = b.speculating != (other > (1 + SWITCH_MARGIN) * kept)
        chosen = spec_widths if speculating else plain_widths
        if speculating != b.speculating:  # the plan changed (after a try, or as costs moved): re-check it soon
            b.interval, b.next_try = EXPLORE, b.cycle + EXPLORE
        elif b.tried:  # a try confirmed the plan: re-check it half as often, or rarer if a try costs much
            lower = try_interval(rows, chosen, verify, draft)
            b.interval = min(max(2 * b.interval, lower), EXPLORE_MAX)
            b.next_try = b.tried + b.interval
        b.tried = 0
        b.speculating = speculating
        if not speculating and any(r.acceptance.cycles < MEASURE_NEW and r.max_width > 1 for r in rows):
            # a request barely measured decodes plainly on its prior, the rate of the requests before it (another
            # workload's, maybe), and nothing else measures it: try next, as often as tries stay under TRY_TAX
            soon = 0
        elif max(spec_rate, plain_rate) < (1 + CLOSE) * min(spec_rate, plain_rate):
            # a close call rests on the other choice's cost as its last tries measured it, one cycle each (one
            # measured 15% slow under load kept two rows speculating for 55 cycles at 0.9x plain's rate): re-measure
            # it every EXPLORE cycles, as cheap as the choices are close
            soon = EXPLORE
        else:
            soon = None
        if soon is not None and b.cycle - b.last_try >= max(soon, try_interval(rows, chosen, verify, draft)):
            b.next_try = min(b.next_try, b.cycle + 1)
        return chosen

    def observe(self, rows: int, width: int, verify_s: float, drafting_rows: int, draft_s: float) -> None:
        verify, draft = self.costs(rows)
        verify.observe(width, verify_s)
        if drafting_rows:
            draft.observe(drafting_rows, draft_s)


class FixedPolicy:
    """--fixed-block: every row verifies its own block (the pre-adaptive behaviour)."""

    def choose(self, rows: list[Row]) -> list[int]:
        return [r.max_width for r in rows]

    def observe(self, *args) -> None:
        pass
