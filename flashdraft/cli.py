"""`flashdraft …` command line."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .errors import FlashdraftError
from .decoding import DEFAULT_TREE, DecodeSettings

COMPARE_RUNS = 3  # --compare-ar pairs: one timing of a ~2 s generation on a shared machine varies by 10-20%

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


def parse_ids(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FlashdraftError(f"{what} must be comma-separated integers, got {text!r}") from None


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative decoding of one prompt",
                       description="Generate with DFlash speculative decoding (lossless: same tokens as the target alone).")
    p.add_argument("prompt", nargs="?", help="prompt text (chat template applied unless --no-chat)")
    p.add_argument("--prompt-ids", help="raw prompt token ids, comma-separated (instead of text)")
    p.add_argument("--no-chat", action="store_true", help="tokenize the prompt as raw text, no chat template")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--drafter", help="drafter directory (z-lab format); default: the one registered for the target")
    p.add_argument("--block-size", type=int, help="tokens verified per cycle (default: the drafter's block_size; 1 = plain decoding)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=DEFAULT_DTYPE)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--stop-token-ids", help="comma-separated stop ids (default: the target's EOS ids)")
    p.add_argument("--loop-stages", type=int, default=1,
                   help="DLoop: up to S drafting stages per cycle, each continuing after the previous stage's "
                        "unverified drafts; the target verifies them all in one pass (default 1 = plain DFlash)")
    p.add_argument("--loop-gate", type=float, default=-0.75,
                   help="DLoop: draft another stage only while the last stage's summed draft log-probability "
                        "exceeds this (default -0.75; lower = more stages)")
    p.add_argument("--json", action="store_true", help="print the machine-readable record instead of streaming text")
    p.add_argument("--no-lookup", action="store_true",
                   help="draft every cycle with the drafter; by default, where the text's last n-gram recurs, the "
                        "tokens that followed it are verified instead (prompt lookup, no drafter pass)")
    p.add_argument("--lookup-tree", action="store_true",
                   help="at temperature 0, verify a prompt-lookup draft as one more path of the drafter's tree "
                        "instead of in its place (higher τ, but a drafter pass and up to 7 more verify rows per "
                        "lookup cycle; see README, Prompt lookup)")
    p.add_argument("--tree", type=int,
                   help="at temperature 0, verify a tree of this many drafted nodes per drafter cycle: the drafter's "
                        f"likeliest continuations, not one chain (default {DEFAULT_TREE}, 0 with DLoop; 0 = the chain)")
    p.add_argument("--compare-ar", action="store_true",
                   help="also decode plainly and report the speedup (median of --compare-runs interleaved pairs of "
                        "runs after a warm-up) and whether outputs are identical")
    p.add_argument("--compare-runs", type=int, default=COMPARE_RUNS, metavar="N",
                   help=f"with --compare-ar: timed pairs of runs (default {COMPARE_RUNS})")
    p.add_argument("--engine", choices=["torch", "llamacpp"], default="torch",
                   help="torch (default) or llamacpp: llama.cpp's own DFlash with the drafter exported to GGUF "
                        "(needs `make llamacpp`)")
    p.add_argument("--gguf", help="llamacpp engine: target file, as bench's --gguf (f32, f16, bf16, q8_0, packaged "
                                  "or a path; default f32)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    import torch

    from .decoding import generate_ids
    from .models import load_drafter_or_plain, load_target
    from .sampling import SamplingParams
    from .target import check_prompt

    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    DecodeSettings(block_size=args.block_size, max_new_tokens=args.max_new_tokens, loop_stages=args.loop_stages,
                   loop_gate=args.loop_gate, tree=args.tree).validate()
    tree = args.tree
    if args.prompt is None and args.prompt_ids is None:
        raise FlashdraftError("give a prompt: flashdraft generate \"text\" or --prompt-ids 1,2,3")
    if args.prompt is not None and args.prompt_ids is not None:
        raise FlashdraftError("give either prompt text or --prompt-ids, not both")
    prompt_ids = parse_ids(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
    if prompt_ids is not None and not prompt_ids:
        raise FlashdraftError("the prompt is empty; give some text or --prompt-ids")
    stops = parse_ids(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids is not None else None
    if args.compare_runs < 1:
        raise FlashdraftError(f"--compare-runs must be >= 1, got {args.compare_runs}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    if args.engine == "torch" and args.gguf:
        raise FlashdraftError("--gguf is for --engine llamacpp")
    if args.engine == "llamacpp" and args.loop_stages != 1:
        raise FlashdraftError("--loop-stages (DLoop) runs on the torch engine only; drop it or use --engine torch")
    if args.engine == "llamacpp" and (args.no_lookup or args.lookup_tree):
        flag = "--no-lookup" if args.no_lookup else "--lookup-tree"
        raise FlashdraftError(f"{flag} is for --engine torch (llama.cpp drafts every cycle); drop it")
    if args.no_lookup and args.lookup_tree:
        raise FlashdraftError("--no-lookup and --lookup-tree contradict each other; pass one")
    if args.engine == "llamacpp" and args.tree is not None:
        raise FlashdraftError("--tree is for --engine torch (llama.cpp verifies a chain); drop it")
    target = load_target(args.target, dtype=args.dtype, device=device)
    ids = prompt_ids if prompt_ids is not None else target.encode(args.prompt, chat=not args.no_chat)
    check_prompt(target.model, ids)
    if args.engine == "llamacpp":
        return generate_llamacpp(args, target, ids, params)
    drafter = load_drafter_or_plain(target, args.drafter, args.block_size)
    block_size = args.block_size if drafter is not None else 1
    stops = target.stop_token_ids() if stops is None else stops
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=params.temperature, top_k=params.top_k,
              top_p=params.top_p, seed=args.seed, stop_token_ids=stops)
    lookup = "tree" if args.lookup_tree else not args.no_lookup
    loop = dict(loop_stages=args.loop_stages, loop_gate=args.loop_gate, lookup=lookup, tree=tree)
    if args.compare_ar:  # warm both paths so neither pays first-call costs in the comparison
        generate_ids(target.model, drafter, ids, block_size=block_size, **{**kw, "max_new_tokens": 4}, **loop)
        generate_ids(target.model, None, ids, block_size=1, **{**kw, "max_new_tokens": 4})
    streamer = None if args.json else Streamer(target)
    result = generate_ids(target.model, drafter, ids, block_size=block_size, on_tokens=streamer, **kw, **loop)
    result.text = target.decode(result.output_ids)
    if streamer:
        streamer.close()
    record = result.to_record()
    t = result.timing
    loop_note = (f", {result.mean_stages:.2f} of up to {args.loop_stages} drafting stages per cycle at gate "
                 f"{args.loop_gate:g}" if args.loop_stages > 1 and result.config["block_size"] > 1 else "")
    look_note = f" ({result.lookup_cycles} by prompt lookup)" if result.config["lookup"] else ""
    tree_note = f", tree {result.config['tree']}" if result.config["tree"] else ""
    summary = (f"flashdraft: {result.num_new_tokens} new tokens, τ {result.tau:.2f} over {len(result.cycles)} cycles"
               f"{look_note}, "
               f"{t.tokens_per_s:.1f} tok/s (block {result.config['block_size']}{tree_note}{loop_note}, {args.dtype})")
    if args.compare_ar:  # interleaved pairs (the streamed run is the first), so drift hits both sides alike
        specs, ars = [result], [generate_ids(target.model, None, ids, block_size=1, **kw)]
        for _ in range(args.compare_runs - 1):
            specs.append(generate_ids(target.model, drafter, ids, block_size=block_size, **kw, **loop))
            ars.append(generate_ids(target.model, None, ids, block_size=1, **kw))
        speedups = [s.timing.tokens_per_s / a.timing.tokens_per_s for s, a in zip(specs, ars)]
        ar_tok_s = statistics.median(a.timing.tokens_per_s for a in ars)
        same = ars[0].output_ids == result.output_ids
        summary += compare_line("autoregressive", ar_tok_s, speedups, same, params)
        record["compare_ar"] = {"identical": same,
                                "speedup": statistics.median(speedups), "speedups": speedups,
                                "ar_tokens_per_s": ar_tok_s, "ar_output_ids": ars[0].output_ids}
    if args.json:
        print(json.dumps(record))
    print(summary, file=sys.stderr)
    return 0


def compare_line(plain: str, plain_tok_s: float, speedups: list[float], same: bool, params,
                 runs: str = "interleaved runs") -> str:
    """The summary's second line: plain speed, the median speedup (and its range over several runs), identity."""
    spread = (f" (median of {len(speedups)} {runs}, {min(speedups):.2f}–{max(speedups):.2f}x)"
              if len(speedups) > 1 else "")
    note = "" if params.greedy else " (sampling: different random streams, identity not expected)"
    return (f"\nflashdraft: {plain} {plain_tok_s:.1f} tok/s → speedup {statistics.median(speedups):.2f}x{spread}; "
            f"outputs identical: {'yes' if same else 'NO'}{note}")


def generate_llamacpp(args, target, ids: list[int], params) -> int:
    """`generate --engine llamacpp`: llama-server with its built-in DFlash (or plain), same flags and record shape."""
    from .bench import resolve_ggufs
    from .config import load_config
    from .llamacpp import LlamaServer, cached_export, tool
    from .models import REGISTRY, registered_drafter

    tool("llama-server")
    gguf = resolve_ggufs([args.gguf or "f32"], target.name)[0]
    src = args.drafter or registered_drafter(target.name)
    block = 1
    if src is not None and args.block_size != 1:
        entry, trained = REGISTRY.get(target.name), load_config(src).block_size
        registered_block = entry.llamacpp_block_size if entry and args.drafter is None else None
        block = args.block_size or registered_block or trained
        if block > trained:
            raise FlashdraftError(f"--block-size {block}: llama.cpp caps DFlash blocks at the drafter's trained block "
                                  f"size {trained}")
    elif src is None:
        if args.block_size not in (None, 1):
            raise FlashdraftError(f"--block-size {args.block_size} needs a drafter: pass --drafter DIR")
        print(f"flashdraft: no drafter registered for {target.name}; decoding plainly.", file=sys.stderr)
    drafter_gguf = cached_export("drafter", Path(src), "f32", args.target) if block > 1 else None
    kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=args.seed)

    def run(draft, n: int = 1) -> list:
        with LlamaServer(gguf.path, draft, block if draft else None) as server:
            server.complete(ids, 4, **kw)  # warm-up, as torch's --compare-ar does
            return [server.complete(ids, args.max_new_tokens, **kw) for _ in range(n)]

    def tokens_per_s(c) -> float:  # decode tok/s as bench counts it: tokens after the first / generation time
        return max(len(c.tokens) - 1, 0) / (c.predicted_ms / 1000) if c.predicted_ms > 0 else 0.0

    runs = run(drafter_gguf, args.compare_runs if args.compare_ar else 1)  # one server per engine: not interleaved
    c = runs[0]
    text = target.decode(c.tokens)
    tok_s = tokens_per_s(c)
    tau = sum(c.acceptance_lengths) / len(c.acceptance_lengths) if c.acceptance_lengths else 1.0
    record = {"output_ids": c.tokens, "text": text, "num_prompt_tokens": len(ids), "num_new_tokens": len(c.tokens),
              "acceptance_lengths": c.acceptance_lengths,
              "timing": {"prefill_s": c.prompt_ms / 1000, "draft_s": (c.draft_ms or 0.0) / 1000,
                         "total_s": (c.prompt_ms + c.predicted_ms) / 1000, "tokens_per_s": tok_s},
              "config": {"engine": "llamacpp", "gguf": str(gguf.path), "block_size": block}}
    summary = (f"flashdraft: {len(c.tokens)} new tokens, τ {tau:.2f} over {len(c.acceptance_lengths)} cycles, "
               f"{tok_s:.1f} tok/s (llama.cpp, {gguf.label}, block {block})")
    if args.compare_ar:
        plains = run(None, args.compare_runs)
        same = plains[0].tokens == c.tokens
        plain_tok_s = [tokens_per_s(p) for p in plains]
        speedups = [tokens_per_s(r) / p if p > 0 else float("nan") for r, p in zip(runs, plain_tok_s)]
        record["compare_ar"] = {"identical": same, "speedup": statistics.median(speedups), "speedups": speedups,
                                "ar_tokens_per_s": statistics.median(plain_tok_s), "ar_output_ids": plains[0].tokens}
        summary += compare_line("llama.cpp plain", statistics.median(plain_tok_s), speedups, same, params,
                                "runs of each")
    print(json.dumps(record) if args.json else text)
    print(summary, file=sys.stderr)
    return 0


def add_export(sub) -> None:
    from .llamacpp import OUTTYPES

    p = sub.add_parser("export", help="write a drafter (or the target) as GGUF for llama.cpp",
                       description="Write a z-lab format drafter (DFlash 1 or 2) as the GGUF that llama.cpp's "
                                   "draft-dflash loads, with its target's tokenizer; without DRAFTER, write the target "
                                   "itself. Uses llama.cpp's own converter from the pinned build (`make llamacpp`).")
    p.add_argument("drafter", nargs="?", help="drafter directory (omit to export the target)")
    p.add_argument("--gguf", required=True, help="output file (written atomically)")
    p.add_argument("--target", help="registered name or local HF model dir (default: smollm2-135m-instruct)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f32", help="weight type in the file (default f32)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from .llamacpp import export_drafter, export_target

    if args.drafter is not None:
        out = export_drafter(args.drafter, args.gguf, args.target, args.outtype)
    else:
        out = export_target(args.target, args.gguf, args.outtype)
    print(f"flashdraft: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.outtype})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description="Lossless speculative decoding with DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    from .train.cli import add_train_commands; add_train_commands(sub)
    from .bench import add_bench; add_bench(sub)  # noqa: E702
    from .serve import add_serve; add_serve(sub)  # noqa: E702
    add_export(sub)
    return parser


NEGATIVE_VALUED = ("--loop-gate",)  # options whose values may start with '-' ("-inf", "-0.5,-1")


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--loop-gate -0.5,-1` → `--loop-gate=-0.5,-1`: argparse takes such a value for an unknown option otherwise."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in NEGATIVE_VALUED and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else list(argv)))
    try:
        return args.func(args)
    except FlashdraftError as e:
        print(f"flashdraft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flashdraft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
