"""vLLM's own DFlash (or plain decoding) in this process: the target's HF directory and a z-lab format drafter run by
vLLM's offline engine (`vllm.LLM`, speculative method `dflash`). vLLM drafts the drafter's chain every cycle: no
DLoop, prompt lookup or trees; it batches, so `generate_many` decodes several prompts together.

What vLLM cannot do on the machine at hand is found out, not assumed: its own refusals (DFlash 2 candidate heads on
the V1 model runner, which is the only one without Triton, i.e. on its CPU build) become one-line errors, and sampled
speculative decoding must pass a statistical self-check first (`sampling_defect`: a chi-square test of its samples
against the target's distribution).
"""

from __future__ import annotations

import gc
import os
import re
from pathlib import Path
from typing import Callable

import torch

from .. import sampling as S
from .. import target as T
from ..config import load_config
from ..decoding import DecodeSettings, GenerationResult, Timing
from ..errors import FlashdraftError
from ..models import REGISTRY, registered_drafter, resolve_target
from . import check_chain_engine

# The engine core in this process (no spawned process to import our __main__), its logs at warnings; a CPU build's
# KV cache sized for one small model (vLLM reserves it up front). Each only where the user has not set it.
# vLLM logs to stdout by default; its warnings belong on stderr, beside ours (stdout carries --json records)
ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "2",
                "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
# An upstream defect of vLLM's CPU build (vllm-project/vllm#55005): its `expand_kernel` shim fills an int64 copy of
# the per-token temperature / top-k / top-p buffers and never copies it back, so sampled speculative decoding reads
# uninitialised memory (garbage text, or an index error).
CPU_SAMPLING_DEFECT = "vllm-project/vllm#55005: the CPU expand_kernel shim leaves sampling parameters uninitialised"


def require_vllm():
    """The vllm module, or the one-line error that says how to install it."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as e:
        raise FlashdraftError(f"vLLM is not installed ({e}): run `make vllm` (its CPU build here, `vllm` on a GPU "
                              "machine)") from None
    return vllm


def is_cpu_build() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def speculative_config(drafter: str | Path, num_speculative_tokens: int) -> dict:
    """vLLM's `--speculative-config` for a z-lab format DFlash drafter (its block size is not read by vLLM: K is
    explicit, drafts after the anchor, so at most block_size - 1)."""
    return {"method": "dflash", "model": str(Path(drafter).resolve()), "num_speculative_tokens": num_speculative_tokens}


def check_drafts(drafter: str | Path, block_size: int) -> int:
    """K = block_size - 1 for vLLM, checked against the drafter's trained block (vLLM would not)."""
    trained = load_config(drafter).block_size
    if not 2 <= block_size <= trained:
        raise FlashdraftError(f"--block-size {block_size}: vLLM drafts block_size - 1 tokens after the anchor, from 2 "
                              f"up to the drafter's trained block size {trained}")
    return block_size - 1


def engine_kwargs(model_dir: str, drafter: str | Path | None, k: int, dtype: str, max_model_len: int,
                  seed: int = 0) -> dict:
    """vLLM engine arguments for model_dir, with a DFlash drafter drafting k tokens unless drafter is None."""
    kw = dict(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=seed,
              disable_log_stats=False)  # per-request stats carry the timings
    if drafter is not None:
        kw |= dict(speculative_config=speculative_config(drafter, k), per_request_spec_decode_metrics="detailed")
    return kw


def refusal(vllm, e: Exception) -> FlashdraftError | None:
    """vLLM's refusal of a configuration (what its model runner here does not support) as one line, else None."""
    found = re.search(r"[^,:\]]*does not support:[^\[]*", " ".join(str(e).split()))
    if found is None:
        return None
    return FlashdraftError(f"vLLM {vllm.__version__} cannot run this here: {found.group(0).strip()} (use a DFlash 1 "
                           "drafter, a GPU build of vLLM, or --engine torch)")


def validated(kw: dict) -> dict:
    """kw once vLLM has accepted them (reading only configs, about a second): refusals before any weights load."""
    vllm = require_vllm()
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(**kw).create_engine_config()
    except (ValueError, NotImplementedError) as e:
        raise refusal(vllm, e) or e from None
    return kw


def sampling_params(settings: DecodeSettings, stop_ids: list[int]):
    """vLLM's SamplingParams for flashdraft's settings: greedy at temperature 0, else the same processing and seed."""
    from vllm import SamplingParams

    s = settings
    common = dict(max_tokens=s.max_new_tokens, stop_token_ids=stop_ids, ignore_eos=not stop_ids, detokenize=False)
    if s.greedy:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=s.temperature, top_k=s.top_k or -1, top_p=s.top_p, seed=s.seed, **common)


def result_of(out, config: dict, speculative: bool = False) -> GenerationResult:
    """One vLLM RequestOutput as a GenerationResult. Its times are vLLM's own per-request stats: prefill_s is the time
    to the first token (arrival → first token), total_s that plus the decode window (first → last token); vLLM times
    no draft or verify phase apart (draft_s, verify_s, other_s None). Acceptance comes from its spec counters
    (reported_acceptance, per verify step: drafts accepted + 1), which a speculative request must have: without them τ
    is unknown, not 1. extras: ttft_s, and first_ts / last_ts, vLLM's engine clock (monotonic) at the first and the
    last token, which the requests of a batch share."""
    c, m = out.outputs[0], out.metrics
    if m is None:
        raise RuntimeError("vLLM returned no request stats (the engine must run with disable_log_stats=False)")
    spec = getattr(c, "spec_decode_metrics", None)
    if speculative and spec is None:
        raise FlashdraftError("vLLM returned no speculative decoding counters for this request, so its acceptance "
                              "(τ) is unknown; use a vLLM with per_request_spec_decode_metrics (`make vllm`) or "
                              "--engine torch")
    acc = [a + 1 for a in spec.per_step_accepted] if spec is not None else []
    ids, ttft = list(c.token_ids), max(m.first_token_latency, 0.0)
    first, last = m.first_token_ts, max(m.last_token_ts, m.first_token_ts)
    decode_s = last - first
    # tokens_per_s is the decode rate after the first token: the tokens after the first over the decode window
    tok_s = max(len(ids) - 1, 0) / decode_s if decode_s > 0 else 0.0
    timing = Timing(prefill_s=ttft, draft_s=None, verify_s=None, other_s=None, total_s=ttft + decode_s,
                    tokens_per_s=tok_s)
    return GenerationResult(ids, len(out.prompt_token_ids), [], timing, config,
                            extras={"ttft_s": ttft, "first_ts": first, "last_ts": last}, reported_acceptance=acc)


SELF_CHECK_PROMPT = "Name three colours and one animal."
SELF_CHECK_SAMPLES = 400  # seeded two-token requests, decoded as one vLLM batch (about a second on a GPU)
SELF_CHECK_ALPHA = 1e-3  # a correct sampler fails about one set of seeds in a thousand (and the seeds are fixed)


def exact_pairs(target, ids: list[int], top_k: int) -> dict[tuple[int, int], float]:
    """P(first, second token | ids) of plain sampling from the target at temperature 1 with top-k (torch, exact)."""
    params, out = S.SamplingParams(1.0, top_k), {}
    with torch.inference_mode():
        dev = target.model.device
        p1 = S.process(target.model(torch.tensor([ids], device=dev)).logits[0, -1], params)
        firsts = [int(t) for t in p1.nonzero().flatten()]
        rows = target.model(torch.tensor([ids + [t] for t in firsts], device=dev)).logits[:, -1]
        for a, p2 in zip(firsts, S.process(rows, params)):
            for b in p2.nonzero().flatten().tolist():
                out[(a, b)] = float(p1[a]) * float(p2[b])
    return out


def chi_square_p(counts: dict, exact: dict[tuple, float]) -> float:
    """Goodness-of-fit p-value of counts against exact probabilities (cells expected below 5 pooled into one)."""
    n = sum(counts.values())
    big = [k for k, p in exact.items() if p * n >= 5]
    obs, exp = [counts.get(k, 0) for k in big], [exact[k] * n for k in big]
    if n - sum(exp) > 1e-9:
        obs.append(n - sum(obs))
        exp.append(n - sum(exp))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    if len(obs) < 2:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sampling_defect(llm, target, seed: int = 0, samples: int = SELF_CHECK_SAMPLES, top_k: int = 4) -> str | None:
    """Why sampled speculative decoding is wrong in this vLLM, or None: `samples` seeded requests of two tokens at
    temperature 1 with top-k (the second token is the first one speculative verification decides), their joint
    distribution tested against the target's own (torch, exact; top_k² cells) by chi-square. A token outside the
    target's top-k fails at once (the CPU build's defect); a sampler that keeps wrong drafts fails the test."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = target.encode(SELF_CHECK_PROMPT)
    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=seed + i, max_tokens=2, ignore_eos=True,
                             detokenize=False) for i in range(samples)]
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids)] * samples, params, use_tqdm=False)
        pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    except Exception as e:  # a sampler reading garbage parameters may index out of range
        return f"sampling raised {type(e).__name__}: {' '.join(str(e).split())[:120]}"
    exact = exact_pairs(target, ids, top_k)
    outside = sum(p not in exact for p in pairs)
    if outside:
        return f"{outside} of {samples} sampled token pairs fall outside the target's top-{top_k}"
    counts: dict[tuple, int] = {}
    for p in pairs:
        counts[p] = counts.get(p, 0) + 1
    pvalue = chi_square_p(counts, exact)
    if pvalue < SELF_CHECK_ALPHA:
        return (f"{samples} samples do not follow the target's distribution (chi-square p = {pvalue:.1e} < "
                f"{SELF_CHECK_ALPHA:g})")
    return None


class VllmEngine:
    """vLLM's offline engine for a target and, unless plain, a DFlash drafter; started at the first request."""

    name = "vllm"
    interleaves = False  # one vLLM engine at a time: a comparison runs all of one engine's runs, then the other's
    plain_name = "vllm plain"

    def __init__(self, target, drafter: Path | None, k: int, kwargs: dict):
        self.target, self.drafter, self.k, self.kwargs = target, drafter, k, kwargs
        self.dtype = kwargs["dtype"]
        self.llm, self.sampling_checked, self.sampling_why = None, False, None

    @classmethod
    def check(cls, settings: DecodeSettings, lookup_flag: str | None = None) -> None:
        """One-line errors for what only the torch engine does."""
        check_chain_engine(settings, lookup_flag, "vLLM")

    @classmethod
    def open(cls, target, drafter: str | Path | None = None, settings: DecodeSettings | None = None, *,
             plain: bool = False) -> VllmEngine:
        """target: a loaded flashdraft Target (its directory is what vLLM loads); drafter: a DFlash directory (None:
        the registered one), run at settings.block_size (default the drafter's trained block)."""
        block = settings.block_size if settings else None
        src = None if plain or block == 1 else drafter or registered_drafter(target.name)  # block 1: plain
        if src is None and not (plain or block == 1):
            raise FlashdraftError(f"no drafter registered for {target.name}: pass --drafter DIR")
        entry = REGISTRY.get(target.name) if drafter is None else None  # the registered drafter's own block size
        k = check_drafts(src, block or (entry and entry.block_size) or load_config(src).block_size) if src else 0
        dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
        kw = engine_kwargs(resolve_target(target.name), src, k, dtype, T.context_limit(target.model))
        return cls(target, Path(src) if src else None, k, validated(kw))

    @property
    def block_size(self) -> int:
        return self.k + 1

    def started(self):
        """The vLLM engine, started now if it has not been."""
        if self.llm is None:
            self.llm = require_vllm().LLM(**self.kwargs)
        return self.llm

    def sampling_problem(self) -> str | None:
        """Why sampled speculative decoding is wrong in this vLLM (its self-check, run once per engine), or None."""
        if not self.sampling_checked:
            self.sampling_why, self.sampling_checked = sampling_defect(self.started(), self.target), True
        return self.sampling_why

    def check_sampling(self, settings: DecodeSettings) -> None:
        """Refuse sampled speculative decoding where vLLM's sampler fails its self-check."""
        if settings.greedy or self.drafter is None:
            return
        why = self.sampling_problem()
        if why:
            known = f" (on its CPU build: {CPU_SAMPLING_DEFECT})" if is_cpu_build() else ""
            raise FlashdraftError(f"vLLM's speculative sampling fails its self-check here: {why}{known}; use "
                                  "--temperature 0, --engine torch, or a vLLM build with the fix")

    def generate_many(self, prompts: list[list[int]], settings: DecodeSettings) -> list[GenerationResult]:
        """All prompts decoded together (vLLM's continuous batching); results in prompt order."""
        from vllm.inputs import TokensPrompt

        self.check_sampling(settings)
        stops = list(settings.stop_token_ids if settings.stop_token_ids is not None else self.target.stop_token_ids())
        outs = self.started().generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                                       sampling_params(settings, stops), use_tqdm=False)
        config = {"engine": "vllm", "block_size": self.block_size, "batch": len(prompts),
                  **({"drafter": str(self.drafter)} if self.drafter else {})}
        results = [result_of(o, config, speculative=self.drafter is not None) for o in outs]
        for r in results:
            r.text = self.target.decode(r.output_ids)
        return results

    def generate(self, prompt_ids: list[int], settings: DecodeSettings,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """One generation (vLLM answers in one piece)."""
        result = self.generate_many([prompt_ids], settings)[0]
        if on_tokens and result.output_ids:
            on_tokens(result.output_ids)
        return result

    def describe(self, result: GenerationResult) -> str:
        """The summary line's account of a generation."""
        acc, rate = result.acceptance_lengths, f"{result.timing.tokens_per_s:.1f} tok/s"
        if self.drafter is None:
            return f"plain decoding, {rate} (vLLM, {self.dtype})"
        tau = f"τ {sum(acc) / len(acc):.2f}" if acc else "τ unknown (no verify step)"
        return f"{tau} over {len(acc)} cycles, {rate} (vLLM, block {self.block_size}, {self.dtype})"

    def close(self) -> None:
        """Stop vLLM's engine and free its KV cache."""
        if self.llm is not None:
            engine = self.llm.llm_engine
            self.llm = None
            shutdown = getattr(engine, "shutdown", None) or getattr(engine.engine_core, "shutdown", None)
            if shutdown:
                shutdown()
            gc.collect()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
