"""Bench methods: each is one small function (target, prompt ids, MethodSettings) → Sample, registered in METHODS.

Which methods run on which engine is the engine registry's (flashdraft.engines.ENGINES): ar and dflash on the torch
engine, llamacpp and llamacpp-dflash on the llama.cpp engine, vllm and vllm-dflash on vLLM (batched: BATCH_METHODS
take several prompts at once), mlx and mlx-dflash on MLX; hf and hf-lookup are transformers' own `generate`. Each
method has a plain baseline on the same engine (ar, llamacpp on the same target file, vllm at the same batch size,
mlx) that its speedup and its token-identity check refer to.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..decoding import DecodeSettings
from ..engines import ENGINES, REFERENCE, get_engine
from ..errors import FlashdraftError

ALL_METHODS = "ar,hf,hf-lookup,dflash"  # the default; llamacpp methods need `make llamacpp`


@dataclass(frozen=True)
class MethodSettings:
    """What a method needs besides the target and the prompt."""

    decode: DecodeSettings
    drafter: object | None = None  # a loaded drafter module (dflash)
    lookup_tokens: int = 10  # prompt_lookup_num_tokens (hf-lookup)
    engine: object | None = None  # an open llama.cpp, vLLM or MLX engine (llamacpp*, vllm*, mlx*)
    batch: int = 1  # prompts decoded together (vllm methods)

    def shortened(self, max_new_tokens: int) -> MethodSettings:
        """The same settings generating at most max_new_tokens (warm-ups)."""
        n = min(max_new_tokens, self.decode.max_new_tokens)
        return replace(self, decode=self.decode.updated(max_new_tokens=n))


@dataclass
class Sample:
    """One generation: output, time to first token, total time, and per-cycle stats where the method has them."""

    output_ids: list[int]
    ttft_s: float
    total_s: float
    first_tokens: int = 1  # tokens that arrived with the first token (prefill); the rest count as decoding
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_s: float | None = None  # None: the method has no per-cycle split
    verify_s: float | None = None
    other_s: float | None = None
    stages: list[int] = field(default_factory=list)  # drafting stages per cycle (drafter methods only)
    lookup_cycles: int = 0  # cycles drafted by prompt lookup instead of the drafter
    cycles: list[dict] | None = None  # the generate record's cycles (drafter methods on the torch engine): for traces


Method = Callable[[object, list[int], MethodSettings], Sample]


# ---------------------------------------------------------------- torch engine

def _torch(target, ids: list[int], settings: DecodeSettings, drafter) -> Sample:
    engine = get_engine("torch").open(target, drafter, plain=drafter is None)
    r = engine.generate(ids, settings)
    t = r.timing
    stages = [c.stages for c in r.cycles] if drafter is not None else []
    return Sample(r.output_ids, t.prefill_s, t.total_s, 1, r.acceptance_lengths, t.draft_s, t.verify_s, t.other_s,
                  stages, r.lookup_cycles, r.to_record()["cycles"] if drafter is not None else None)


def run_ar(target, ids: list[int], s: MethodSettings) -> Sample:
    """flashdraft's own loop at block size 1 (the reference)."""
    return _torch(target, ids, s.decode.updated(block_size=1), None)


def run_dflash(target, ids: list[int], s: MethodSettings) -> Sample:
    """DFlash speculative decoding with s.drafter (DFlash 1 or 2) at the block size of s.decode (default: the
    drafter's), with DLoop when its loop_stages > 1."""
    return _torch(target, ids, s.decode, s.drafter)


# ---------------------------------------------------------------- transformers

class _Clock:
    """A `generate` streamer that timestamps each chunk of new tokens (the first put is the prompt)."""

    def __init__(self):
        self.t0, self.prompt_seen, self.times, self.chunks = time.perf_counter(), False, [], []

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.chunks.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def _hf(target, ids: list[int], s: DecodeSettings, **extra) -> Sample:
    """transformers `generate` (greedy, or sampling with the same settings), timed per chunk by a streamer."""
    import torch  # local: `flashdraft bench --help` reads METHODS from this module without loading torch

    model = target.model
    clock = _Clock()
    stops = list(s.stop_token_ids)
    kw = dict(do_sample=not s.temperature == 0, max_new_tokens=s.max_new_tokens, min_new_tokens=0,
              eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, streamer=clock)
    if s.temperature > 0:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        torch.manual_seed(s.seed)
    x = torch.tensor([ids], device=model.device)
    clock.t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), **kw, **extra)
    total = time.perf_counter() - clock.t0
    out, chunks = [], []
    for chunk in clock.chunks:  # cut right after the first stop token, as flashdraft does
        cut = next((i + 1 for i, t in enumerate(chunk) if t in stops), None)
        out.extend(chunk[:cut])
        chunks.append(len(chunk[:cut]))
        if cut is not None:
            break
    ttft = clock.times[0] - clock.t0 if clock.times else total
    return Sample(out, ttft, total, chunks[0] if chunks else 0, chunks)


def run_hf(target, ids: list[int], s: MethodSettings) -> Sample:
    """transformers `model.generate`."""
    return _hf(target, ids, s.decode)


def run_hf_lookup(target, ids: list[int], s: MethodSettings) -> Sample:
    """transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)."""
    return _hf(target, ids, s.decode, prompt_lookup_num_tokens=s.lookup_tokens)


# ---------------------------------------------------------------- llama.cpp engine

def run_llamacpp(target, ids: list[int], s: MethodSettings) -> Sample:
    """llama.cpp's llama-server, plain or with its built-in DFlash; times are the server's own (no HTTP)."""
    r = s.engine.generate(ids, s.decode)
    t = r.timing
    ttft, gen = t.prefill_s, t.total_s - t.prefill_s
    if t.draft_s is None:  # plain, or no draft timer in the server's log: the cycles stay, the split is missing
        return Sample(r.output_ids, ttft, t.total_s, 1, r.acceptance_lengths)
    # llama.cpp times drafting alone; the rest of a cycle counts as verify
    return Sample(r.output_ids, ttft, t.total_s, 1, r.acceptance_lengths, t.draft_s, max(0.0, gen - t.draft_s), 0.0)


# ---------------------------------------------------------------- vLLM engine

def run_vllm_batch(target, prompts: list[list[int]], s: MethodSettings) -> list[Sample]:
    """vLLM's offline engine, plain or with its DFlash, on prompts decoded together. Times are vLLM's own per-request
    stats; the batch's decode window (first token of any to last token of any) is shared out by decode tokens, so
    pooled decode tok/s is the batch's output throughput (at batch 1: the request's own rate)."""
    rs = s.engine.generate_many(prompts, s.decode)
    window = max(r.extras["last_ts"] for r in rs) - min(r.extras["first_ts"] for r in rs)
    dec = [max(r.num_new_tokens - 1, 0) for r in rs]
    return [Sample(r.output_ids, r.timing.prefill_s, r.timing.prefill_s + window * d / max(sum(dec), 1),
                   min(r.num_new_tokens, 1), r.acceptance_lengths) for r, d in zip(rs, dec)]


def run_vllm(target, ids: list[int], s: MethodSettings) -> Sample:
    """One prompt on vLLM (warm-ups; the bench runs vllm methods in batches through run_vllm_batch)."""
    return run_vllm_batch(target, [ids], s)[0]


# ---------------------------------------------------------------- MLX engine

def run_mlx(target, ids: list[int], s: MethodSettings) -> Sample:
    """The MLX engine, plain or with the drafter in MLX; a cycle is one lazy graph, so it has no draft/verify split."""
    r = s.engine.generate(ids, s.decode)
    drafted = s.engine.drafter is not None
    return Sample(r.output_ids, r.timing.prefill_s, r.timing.total_s, 1, r.acceptance_lengths,
                  stages=[c.stages for c in r.cycles] if drafted else [], lookup_cycles=r.lookup_cycles)


# How one sample runs on each engine: (plain, with a drafter); the methods' names are the engine registry's
RUNS: dict[str, tuple[Method, Method]] = {"torch": (run_ar, run_dflash), "llamacpp": (run_llamacpp, run_llamacpp),
                                          "vllm": (run_vllm, run_vllm), "mlx": (run_mlx, run_mlx)}
HF_METHODS: dict[str, Method] = {"hf": run_hf, "hf-lookup": run_hf_lookup}  # transformers' own, on no engine
ENGINE_METHODS: dict[str, Method] = {m: run for name, e in ENGINES.items() for m, run in zip(e.methods, RUNS[name])}
REFERENCE_METHOD = ENGINES[REFERENCE].plain_method  # ar: every other method is compared with it
METHODS: dict[str, Method] = {REFERENCE_METHOD: ENGINE_METHODS[REFERENCE_METHOD], **HF_METHODS, **ENGINE_METHODS}
# swept over --drafter × --block-size (× DLoop: dflash)
DRAFTER_METHODS = {e.drafter_method for e in ENGINES.values()}
LLAMACPP_METHODS = set(ENGINES["llamacpp"].methods)  # swept over --gguf
VLLM_METHODS = set(ENGINES["vllm"].methods)  # swept over --batch
MLX_METHODS = set(ENGINES["mlx"].methods)
BATCH_METHODS = dict.fromkeys(VLLM_METHODS, run_vllm_batch)  # run a variant at a time, batch by batch
# a drafter method's plain baseline on its own engine, always run (the reference engine's is the reference itself)
PLAIN_OF = {e.drafter_method: e.plain_method for name, e in ENGINES.items() if name != REFERENCE}


def parse_methods(text: str, reference: bool = True) -> list[str]:
    """--methods as a list, with ar (the reference) first unless --no-ar."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise FlashdraftError(f"--methods: unknown {bad or text!r}; choose from {', '.join(METHODS)}")
    methods = [m for m in dict.fromkeys(methods) if m != REFERENCE_METHOD]
    if not reference and not methods:
        raise FlashdraftError("--no-ar leaves no method to run; add one to --methods")
    for m, plain in PLAIN_OF.items():
        if reference and m in methods and plain not in methods:  # its baseline
            methods.insert(methods.index(m), plain)
    return ([REFERENCE_METHOD] if reference else []) + methods
