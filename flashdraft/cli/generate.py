"""`flashdraft generate`: one prompt, streamed or as a JSON record, on any engine; --compare-ar adds the plain
baseline of the same engine."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys

from ..decoding.settings import DecodeSettings, add_decode_arguments, lookup_flag, parse_ids, settings_from_args
from ..engines import ENGINES, get_engine
from ..errors import FlashdraftError
from .trace import trace_for_generate

COMPARE_RUNS = 3  # --compare-ar pairs: one timing of a ~2 s generation on a shared machine varies by 10-20%
WARM_UP_TOKENS = 4
DEFAULT_DTYPE = "float32"


class Streamer:
    """Prints text as tokens are accepted, holding back an incomplete multi-byte character."""

    def __init__(self, target):
        self.target, self.ids, self.shown = target, [], 0

    def __call__(self, new: list[int]) -> None:
        self.ids.extend(new)
        text = self.target.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = len(text)

    def close(self) -> None:
        text = self.target.decode(self.ids)
        sys.stdout.write(text[self.shown:] + "\n")
        sys.stdout.flush()


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative decoding of one prompt",
                       description="Generate with DFlash speculative decoding (lossless: same tokens as the target alone).")
    p.add_argument("prompt", nargs="?", help="prompt text (chat template applied unless --no-chat)")
    p.add_argument("--prompt-ids", help="raw prompt token ids, comma-separated (instead of text)")
    p.add_argument("--no-chat", action="store_true", help="tokenize the prompt as raw text, no chat template")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--drafter", help="drafter directory (z-lab format); default: the one registered for the target")
    add_decode_arguments(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=DEFAULT_DTYPE)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print the machine-readable record instead of streaming text")
    p.add_argument("--trace", metavar="FILE.html",
                   help="also write the generation's trace page: every cycle's drafts, kept and rejected (see "
                        "`flashdraft trace`)")
    p.add_argument("--compare-ar", action="store_true",
                   help="also decode plainly and report the speedup (median of --compare-runs interleaved pairs of "
                        "runs after a warm-up) and whether outputs are identical")
    p.add_argument("--compare-runs", type=int, default=COMPARE_RUNS, metavar="N",
                   help=f"with --compare-ar: timed pairs of runs (default {COMPARE_RUNS})")
    p.add_argument("--engine", choices=list(ENGINES), default="torch",
                   help="torch (default) or llamacpp: llama.cpp's own DFlash with the drafter exported to GGUF "
                        "(needs `make llamacpp`)")
    p.add_argument("--gguf", help="llamacpp engine: target file, as bench's --gguf (f32, f16, bf16, q8_0, packaged "
                                  "or a path; default f32)")
    p.set_defaults(func=cmd_generate)


def prompt_ids_from(args) -> list[int] | None:
    """--prompt-ids as ids (None: the prompt is text); one-line errors for no prompt, two prompts, an empty one."""
    if args.prompt is None and args.prompt_ids is None:
        raise FlashdraftError("give a prompt: flashdraft generate \"text\" or --prompt-ids 1,2,3")
    if args.prompt is not None and args.prompt_ids is not None:
        raise FlashdraftError("give either prompt text or --prompt-ids, not both")
    ids = parse_ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
    if ids is not None and not ids:
        raise FlashdraftError("the prompt is empty; give some text or --prompt-ids")
    return ids


def engine_options(args) -> dict:
    """The options only one engine takes: --gguf is llama.cpp's target file."""
    if args.engine == "llamacpp":
        return {"gguf": args.gguf or "f32"}
    if args.gguf:
        raise FlashdraftError("--gguf is for --engine llamacpp")
    return {}


def baseline_settings(s: DecodeSettings) -> DecodeSettings:
    """Plain decoding with the same length, sampling and stops (the --compare-ar side)."""
    return DecodeSettings(block_size=1, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, seed=s.seed, stop_token_ids=s.stop_token_ids)


def shown_run(engine, ids: list[int], settings: DecodeSettings, streamer: Streamer | None):
    result = engine.generate(ids, settings, streamer)
    if streamer:
        streamer.close()
    return result


def runs_interleaved(spec, plain, ids: list[int], settings: DecodeSettings, n: int, streamer: Streamer | None):
    """(drafted runs, plain runs) in one process: a warm-up of each, then pairs (the first drafted run shown), so
    drift hits both sides alike."""
    base = baseline_settings(settings)
    with spec, plain or contextlib.nullcontext():
        if plain:  # warm both paths so neither pays first-call costs in the comparison
            spec.generate(ids, settings.updated(max_new_tokens=WARM_UP_TOKENS))
            plain.generate(ids, base.updated(max_new_tokens=WARM_UP_TOKENS))
        specs, plains = [shown_run(spec, ids, settings, streamer)], []
        if plain:
            plains.append(plain.generate(ids, base))
            for _ in range(n - 1):
                specs.append(spec.generate(ids, settings))
                plains.append(plain.generate(ids, base))
    return specs, plains


def runs_apart(spec, plain, ids: list[int], settings: DecodeSettings, n: int, streamer: Streamer | None):
    """(drafted runs, plain runs) one engine at a time (a server each), each after its own warm-up."""
    base = baseline_settings(settings)
    with spec:
        spec.generate(ids, settings.updated(max_new_tokens=WARM_UP_TOKENS))
        specs = [shown_run(spec, ids, settings, streamer)] + [spec.generate(ids, settings) for _ in range(n - 1)]
    if not plain:
        return specs, []
    with plain:
        plain.generate(ids, base.updated(max_new_tokens=WARM_UP_TOKENS))
        return specs, [plain.generate(ids, base) for _ in range(n)]


def compare_line(plain: str, plain_tok_s: float, speedups: list[float], same: bool, greedy: bool,
                 runs: str = "interleaved runs") -> str:
    """The summary's second line: plain speed, the median speedup (and its range over several runs), identity."""
    spread = (f" (median of {len(speedups)} {runs}, {min(speedups):.2f}–{max(speedups):.2f}x)"
              if len(speedups) > 1 else "")
    note = "" if greedy else " (sampling: different random streams, identity not expected)"
    return (f"\nflashdraft: {plain} {plain_tok_s:.1f} tok/s → speedup {statistics.median(speedups):.2f}x{spread}; "
            f"outputs identical: {'yes' if same else 'NO'}{note}")


def compare_with_plain(specs: list, plains: list, engine_cls, greedy: bool) -> tuple[dict, str]:
    """The record's compare_ar and the summary's comparison line."""
    plain_tok_s = [p.timing.tokens_per_s for p in plains]
    speedups = [s.timing.tokens_per_s / p if p > 0 else float("nan") for s, p in zip(specs, plain_tok_s)]
    same = plains[0].output_ids == specs[0].output_ids
    record = {"identical": same, "speedup": statistics.median(speedups), "speedups": speedups,
              "ar_tokens_per_s": statistics.median(plain_tok_s), "ar_output_ids": plains[0].output_ids}
    runs = "interleaved runs" if engine_cls.interleaves else "runs of each"
    return record, compare_line(engine_cls.plain_name, record["ar_tokens_per_s"], speedups, same, greedy, runs)


def cmd_generate(args) -> int:
    settings = settings_from_args(args)
    prompt_ids = prompt_ids_from(args)
    if args.compare_runs < 1:
        raise FlashdraftError(f"--compare-runs must be >= 1, got {args.compare_runs}")
    options = engine_options(args)
    return generate_run(args, settings, prompt_ids, options)  # the flags passed: now the engine and torch load


def generate_run(args, settings: DecodeSettings, prompt_ids: list[int] | None, options: dict) -> int:
    """Open the engine (and its plain baseline), decode, print the text or record and the summary line."""
    import torch

    from ..models import load_target
    from ..target import check_prompt

    engine_cls = get_engine(args.engine)
    engine_cls.check(settings, lookup_flag(args))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, dtype=args.dtype, device=device)
    ids = prompt_ids if prompt_ids is not None else target.encode(args.prompt, chat=not args.no_chat)
    check_prompt(target.model, ids)
    spec = engine_cls.open(target, args.drafter, settings, **options)
    plain = engine_cls.open(target, settings=baseline_settings(settings), plain=True, **options) if args.compare_ar \
        else None
    runs = runs_interleaved if engine_cls.interleaves else runs_apart
    specs, plains = runs(spec, plain, ids, settings, args.compare_runs if args.compare_ar else 1,
                         None if args.json else Streamer(target))
    record = specs[0].to_record()
    summary = f"flashdraft: {specs[0].num_new_tokens} new tokens, {spec.describe(specs[0])}"
    if plains:
        record["compare_ar"], line = compare_with_plain(specs, plains, engine_cls, settings.greedy)
        summary += line
    if args.json:
        print(json.dumps(record))
    if args.trace:
        summary += f"\nflashdraft: trace page {trace_for_generate(record, target, args.trace)}"
    print(summary, file=sys.stderr)
    return 0
