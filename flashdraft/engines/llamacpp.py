"""llama.cpp's own DFlash (or plain decoding) through llama-server: the target as a GGUF file, the drafter exported
to GGUF. llama.cpp drafts the drafter's chain every cycle: no DLoop, prompt lookup or trees, and blocks no larger
than the drafter was trained with."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from .. import target as T
from ..config import load_config
from ..decoding import DecodeSettings, GenerationResult, Timing
from ..decoding.settings import DEFAULTS
from ..errors import FlashdraftError
from ..llamacpp.build import tool
from ..llamacpp.gguf import Gguf, cached_export, resolve_ggufs
from ..llamacpp.server import Completion, LlamaServer
from ..models import REGISTRY, registered_drafter
from . import check_chain_engine


def completion_result(c: Completion, num_prompt_tokens: int, config: dict, text: str = "") -> GenerationResult:
    """One llama-server generation as a GenerationResult. Its times are the server's own (no HTTP): prefill_s its
    prompt time, draft_s its drafting timer (None: plain decoding, or no draft timer in the server's log: missing, not
    zero); it does not time verification apart (verify_s, other_s None). llama.cpp reports no blocks, only each
    cycle's accepted drafts (reported_acceptance); its raw ms timers are in extras."""
    draft_s = None if c.draft_ms is None else c.draft_ms / 1000
    # tokens_per_s is the decode rate: the tokens after the first over the server's generation time (the prefill's
    # first token is not counted), as llama.cpp reports its own speed
    tok_s = max(len(c.tokens) - 1, 0) / (c.predicted_ms / 1000) if c.predicted_ms > 0 else 0.0
    timing = Timing(prefill_s=c.prompt_ms / 1000, draft_s=draft_s, verify_s=None, other_s=None,
                    total_s=(c.prompt_ms + c.predicted_ms) / 1000, tokens_per_s=tok_s)
    return GenerationResult(c.tokens, num_prompt_tokens, [], timing, config, text,
                            extras={"prompt_ms": c.prompt_ms, "predicted_ms": c.predicted_ms, "draft_ms": c.draft_ms},
                            reported_acceptance=list(c.acceptance_lengths))


MAX_CTX = 8192  # llama-server allocates its whole KV cache up front: beyond this it only wastes memory here


def server_context(target) -> int:
    """llama-server's context: the target's (what prompts are checked against), capped at MAX_CTX."""
    return min(T.context_limit(target.model), MAX_CTX)


def drafter_block(target, drafter: str | Path | None, block_size: int | None) -> tuple[Path | None, int]:
    """(drafter directory, block size) for llama.cpp's DFlash; block 1 decodes plainly. The registered drafter runs
    at the registry's llama.cpp block size, any other at its trained one unless block_size says otherwise."""
    src = drafter or registered_drafter(target.name)
    if src is None:
        if block_size not in (None, 1):
            raise FlashdraftError(f"--block-size {block_size} needs a drafter: pass --drafter DIR")
        print(f"flashdraft: no drafter registered for {target.name}; decoding plainly.", file=sys.stderr)
        return None, 1
    if block_size == 1:
        return Path(src), 1
    entry, trained = REGISTRY.get(target.name), load_config(src).block_size
    registered_block = entry.llamacpp_block_size if entry and drafter is None else None
    block = block_size or registered_block or trained
    if block > trained:
        raise FlashdraftError(f"--block-size {block}: llama.cpp caps DFlash blocks at the drafter's trained block "
                              f"size {trained}")
    return Path(src), block


class LlamaCppEngine:
    """One llama-server (started at the first request) for a target file and, unless plain, a DFlash drafter."""

    name = "llamacpp"
    interleaves = False  # one server at a time: a comparison runs all of one engine's runs, then the other's
    plain_name = "llama.cpp plain"

    def __init__(self, target, server: LlamaServer, gguf: Gguf, block_size: int):
        self.target, self.server, self.gguf, self.block_size = target, server, gguf, block_size

    @classmethod
    def check(cls, settings: DecodeSettings, lookup_flag: str | None = None) -> None:
        """One-line errors for what only the torch engine does."""
        check_chain_engine(settings, lookup_flag, "llama.cpp")
        if settings.stop_token_ids is not None:
            raise FlashdraftError("--stop-token-ids is for --engine torch: llama-server stops at the model's own "
                                  "end-of-generation tokens; drop it")

    @classmethod
    def open(cls, target, drafter: str | Path | None = None, settings: DecodeSettings | None = None, *,
             plain: bool = False, gguf: str | Gguf = "f32", threads: int | None = None,
             ctx: int | None = None) -> LlamaCppEngine:
        """gguf: the target file (an outtype exported once, `packaged`, a path, or a resolved Gguf); threads: llama.cpp
        threads (default all cores); ctx: the server's context (default: the target's, capped at MAX_CTX)."""
        tool("llama-server")  # fail before any export when llama.cpp is not built
        ctx = ctx or server_context(target)
        file = gguf if isinstance(gguf, Gguf) else resolve_ggufs([gguf], target.name)[0]
        if plain:
            return cls(target, LlamaServer(file.path, threads=threads, ctx=ctx), file, 1)
        src, block = drafter_block(target, drafter, (settings or DEFAULTS).block_size)
        drafter_gguf = cached_export("drafter", src, "f32", target.name) if block > 1 else None
        server = LlamaServer(file.path, drafter_gguf, block if drafter_gguf else None, threads, ctx)
        return cls(target, server, file, block)

    def generate(self, prompt_ids: list[int], settings: DecodeSettings,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Greedy at temperature 0, else the same temperature / top-k / top-p as flashdraft; the server's own EOS."""
        s, ctx = settings, self.server.ctx
        if len(prompt_ids) >= ctx:
            raise FlashdraftError(f"the prompt has {len(prompt_ids)} tokens but llama-server runs with a context of {ctx}; "
                                  "shorten the prompt or use --engine torch")
        # like the torch engine, stop at the context's end (llama-server would otherwise shift the context)
        c = self.server.complete(prompt_ids, min(s.max_new_tokens, ctx - len(prompt_ids)), s.temperature, s.top_k,
                                 s.top_p, s.seed)
        config = {"engine": "llamacpp", "gguf": str(self.gguf.path), "block_size": self.block_size}
        result = completion_result(c, len(prompt_ids), config, self.target.decode(c.tokens))
        if on_tokens and c.tokens:
            on_tokens(c.tokens)  # the server answers in one piece
        return result

    def describe(self, result: GenerationResult) -> str:
        """The summary line's account of a generation."""
        acc = result.acceptance_lengths
        tau = sum(acc) / len(acc) if acc else 1.0
        return (f"τ {tau:.2f} over {len(acc)} cycles, {result.timing.tokens_per_s:.1f} tok/s "
                f"(llama.cpp, {self.gguf.label}, block {self.block_size})")

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> LlamaCppEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
