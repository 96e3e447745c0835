"""`flashdraft bench`: its flags, the sweep they describe, and the run from loading to the report. The flags are
checked before anything heavy loads; the run's modules (torch, the engines, the sweep) load in bench_run."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..bench.datasets import HUB_DATASETS, Prompt, load_dataset, parse_dataset
from ..bench.methods import (ALL_METHODS, LLAMACPP_METHODS, METHODS, MLX_METHODS, VLLM_METHODS, MethodSettings,
                             parse_methods)
from ..decoding.settings import DecodeSettings, add_decode_arguments, parse_ids, parse_list, parse_lookup
from ..errors import FlashdraftError
from .trace import trace_bench

if TYPE_CHECKING:
    from ..bench.variants import Sweep, Variant


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark ar / hf / hf-lookup / dflash on datasets",
                       description="Compare decoding methods on the same prompts, target, dtype and machine; "
                                   "check losslessness at temperature 0; write JSONL, JSON, Markdown and plots.")
    p.add_argument("--dataset", action="append", required=True,
                   help=f"JSONL path ({{\"turns\": [...]}} records), NAME=PATH, or one of {', '.join(HUB_DATASETS)} "
                        "(repeatable)")
    p.add_argument("--methods", default=ALL_METHODS,
                   help=f"comma-separated, from {', '.join(METHODS)} (default {ALL_METHODS}; ar is always run as the "
                        "reference, llamacpp with llamacpp-dflash, vllm with vllm-dflash, mlx with mlx-dflash; the "
                        "llamacpp methods need `make llamacpp`, the vllm methods `make vllm`, the mlx methods `make mlx`)")
    p.add_argument("--batch", default="1",
                   help="vllm methods: prompts decoded together, a comma-separated sweep (e.g. 1,4,8; default 1); "
                        "tok/s is then the batch's output throughput")
    p.add_argument("--gguf", action="append",
                   help="target file for the llamacpp methods (repeatable): f32, f16, bf16 or q8_0 (the target "
                        "exported once with llama.cpp's converter, cached), packaged (the registered target's own "
                        "GGUF, e.g. Q4_1), or a GGUF path (default: f32)")
    p.add_argument("--profile", action="store_true",
                   help="after the run, measure each engine's plain step, verify(B) and draft(B) for B in 2..16 and "
                        "print the break-even τ and best block size (cost profile)")
    p.add_argument("--profile-tokens", type=int, default=128,
                   help="tokens each profile run generates from the first prompt (default 128)")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--drafter", action="append", help="drafter directory for dflash (repeatable; default: registered)")
    add_decode_arguments(p, sweep=True)  # the DFlash settings (block size, lookup, tree, DLoop) sweep over lists
    p.add_argument("--max-samples", type=int, help="prompts per dataset (a fixed-seed random subset)")
    p.add_argument("--subsample-seed", type=int, default=0, help="seed for --max-samples sub-sampling (default 0)")
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-lookup (default 10)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch and llama.cpp (default: torch every core while the machine is free, "
                        "fewer while other processes hold cores; llama.cpp all cores)")
    p.add_argument("--no-chat", action="store_true", help="tokenize prompts as raw text, no chat template")
    p.add_argument("--no-ar", action="store_true",
                   help="skip the ar reference: no speedup vs ar and no token-identity check (for τ-only sweeps, "
                        "where ar would double the cost)")
    p.add_argument("--limit-time", type=float, help="stop starting new runs after SECONDS and report what finished")
    p.add_argument("--out", required=True, help="results directory (re-running with it resumes)")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="write trace pages (OUT/traces/*.html, see `flashdraft trace`) for the N drafting samples "
                        "with the lowest τ")
    p.set_defaults(func=cmd_bench)


# ---------------------------------------------------------------- flags → checked values

def check_bench_args(args) -> list[str]:
    """Every flag checked (one-line errors, nothing loaded yet); returns the methods to run."""
    DecodeSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p).validate()
    if args.trace < 0:
        raise FlashdraftError(f"--trace takes a count of samples >= 0, got {args.trace}")
    if args.max_samples is not None and args.max_samples < 1:
        raise FlashdraftError(f"--max-samples must be >= 1, got {args.max_samples}")
    if args.limit_time is not None and not args.limit_time > 0:
        raise FlashdraftError(f"--limit-time must be > 0 seconds, got {args.limit_time}")
    if args.threads is not None and args.threads < 1:
        raise FlashdraftError(f"--threads must be >= 1, got {args.threads}")
    for b in parse_list(args.batch, "--batch", int):
        if b < 1:
            raise FlashdraftError(f"--batch takes prompt counts >= 1, got {b}")
    if args.profile_tokens < 2:
        raise FlashdraftError(f"--profile-tokens must be >= 2, got {args.profile_tokens}")
    if args.lookup_tokens < 1:
        raise FlashdraftError(f"--lookup-tokens must be >= 1, got {args.lookup_tokens}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FlashdraftError(f"--out {out} exists and is not a directory")
    methods = parse_methods(args.methods, reference=not args.no_ar)
    stages, _ = parse_loops(args)
    parse_lookup(args.lookup)
    parse_trees(args.tree, stages)
    if set(parse_list(args.batch, "--batch", int)) != {1} and not VLLM_METHODS & set(methods):
        raise FlashdraftError("--batch is for the vllm methods; add vllm or vllm-dflash to --methods")
    if args.gguf and not LLAMACPP_METHODS & set(methods):
        raise FlashdraftError("--gguf is for the llamacpp methods; add llamacpp or llamacpp-dflash to --methods")
    return methods


def parse_loops(args) -> tuple[list[int], list[float]]:
    """--loop-stages and --loop-gate as checked lists."""
    stages, gates = parse_list(args.loop_stages, "--loop-stages", int), parse_list(args.loop_gate, "--loop-gate", float)
    for s in stages:
        for g in gates:
            DecodeSettings(loop_stages=s, loop_gate=g).validate()
    return stages, gates


def parse_trees(text: str | None, loop_stages: list[int]) -> list[int | None]:
    """--tree '0,7' → [0, 7], checked (node counts >= 0; trees and DLoop do not combine); none given: [None], each
    variant's default (DEFAULT_TREE, the chain under DLoop)."""
    if text is None:
        return [None]
    trees = list(dict.fromkeys(parse_list(text, "--tree", int)))
    for t in trees:
        if t < 0:
            raise FlashdraftError(f"--tree takes node counts >= 0 (0 verifies the drafter's chain), got {t}")
    if any(trees) and max(loop_stages) > 1:
        raise FlashdraftError("--tree and --loop-stages > 1 do not combine; sweep them in separate runs")
    return trees


def sweep_from_args(args) -> Sweep:
    """What the drafter methods run over (target files are added once the target is known)."""
    from ..bench.variants import Sweep, loop_settings

    stages, gates = parse_loops(args)
    lookups = parse_lookup(args.lookup)
    return Sweep(drafters=args.drafter or [None], block_sizes=args.block_size or [],
                 loops=loop_settings(stages, gates), lookups=lookups, trees=parse_trees(args.tree, stages),
                 threads=args.threads, batches=list(dict.fromkeys(parse_list(args.batch, "--batch", int))))


def load_datasets(args) -> dict[str, list[Prompt]]:
    labels = [parse_dataset(d) for d in args.dataset]
    if len({lab for lab, _ in labels}) != len(labels):
        raise FlashdraftError(f"two datasets share the label {[lab for lab, _ in labels]}; use NAME=PATH to name them")
    return {lab: load_dataset(lab, src, args.max_samples, args.subsample_seed) for lab, src in labels}


def stop_ids(args, target) -> list[int]:
    return parse_ids(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids is not None \
        else target.stop_token_ids()


def run_config(args, target, device: str, uses_llamacpp: bool, uses_vllm: bool = False) -> dict:
    """The settings a results directory is tied to (resuming with others is refused)."""
    from ..engines.vllm import require_vllm
    from ..llamacpp.build import LLAMACPP_VERSION
    from ..packed import is_packed, packed_kind

    config = {"target": target.name, "dtype": args.dtype, "device": device, "chat": not args.no_chat,
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "lookup_tokens": args.lookup_tokens,
              "packed_linears": is_packed(target.model)}
    if config["packed_linears"]:  # which kernel ran them (kept out when unpacked, so older results still resume)
        config["linear_kernel"] = packed_kind(target.model)
    if args.stop_token_ids is not None:  # only when given, so runs with the target's own stop ids keep their config
        config["stop_token_ids"] = stop_ids(args, target)
    if uses_llamacpp:
        config["llamacpp"] = LLAMACPP_VERSION
    if uses_vllm:
        config["vllm"] = require_vllm().__version__
    return config


# ---------------------------------------------------------------- the command

def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_and_profile(args, target, datasets: dict, variants: list[Variant], out: Path,
                    engines: list) -> tuple[str | None, bool, dict | None]:
    """(why the run stopped early or None, whether it was interrupted, the cost profile when measured); every
    engine is closed afterwards."""
    from ..bench.profile import run_profile
    from ..bench.runs import run_bench

    stopped, interrupted, profile = None, False, None
    # Background jobs ignore SIGINT, so `kill` (SIGTERM) must also stop cleanly and leave a report.
    on_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        stopped = run_bench(target, datasets, variants, out, not args.no_chat, args.limit_time)
        if args.profile and not stopped:
            profile = run_profile(target, variants, datasets, out, not args.no_chat, args.threads, args.profile_tokens)
    except KeyboardInterrupt:
        stopped, interrupted = "interrupted", True
    finally:
        signal.signal(signal.SIGTERM, on_term)
        for engine in engines:
            engine.close()
    return stopped, interrupted, profile


def report(args, out: Path, datasets: dict, variants: list[Variant], config: dict, stopped: str | None,
           profile: dict | None, target) -> dict:
    """Summarize this run's records (those of its datasets and variants) and write and print the report."""
    from ..bench import report as R
    from ..bench.runs import load_records

    labels = {v.label for v in variants}
    records = [r for r in load_records(out / "samples.jsonl")
               if r["dataset"] in datasets and r["method"] in labels
               and r["id"] in {p.id for p in datasets[r["dataset"]]}]
    if profile is None and args.profile and (out / "profile.json").is_file():
        profile = json.loads((out / "profile.json").read_text())  # a finished run resumed: its profile stands
    summary = R.summarize(records, [v.label for v in variants], config, datasets, stopped,
                          {v.label: v.desc for v in variants}, profile)
    R.write_all(out, summary)
    R.print_summary(summary, out)
    if args.trace:
        paths = trace_bench(records, target, out / "traces", args.trace)
        print(f"flashdraft: {len(paths)} trace page(s) in {out / 'traces'}", file=sys.stderr)
    return summary


def cmd_bench(args) -> int:
    return bench_run(args, check_bench_args(args))


def bench_run(args, methods: list[str]) -> int:
    """Load the target, open the engines and build the sweep's variants, run them (resuming), report."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..bench.runs import check_results_dir
    from ..bench.variants import build_variants
    from ..engines.vllm import require_vllm
    from ..llamacpp.build import tool
    from ..llamacpp.gguf import resolve_ggufs
    from ..mlx import require_mlx
    from ..models import load_target
    from ..threads import pin as pin_threads

    sweep = sweep_from_args(args)
    uses_vllm, uses_llamacpp = bool(VLLM_METHODS & set(methods)), bool(LLAMACPP_METHODS & set(methods))
    if uses_vllm:
        require_vllm()  # fail before any work when vLLM is missing
    if MLX_METHODS & set(methods):
        require_mlx()
    datasets = load_datasets(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        pin_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device=device)
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_token_ids=stop_ids(args, target))
    if uses_llamacpp:
        tool("llama-server")  # fail before any work when llama.cpp is not built
        sweep.ggufs = resolve_ggufs(args.gguf, target.name)
    engines: list = []
    variants = build_variants(target, methods, MethodSettings(decode, lookup_tokens=args.lookup_tokens), sweep, engines)
    config = run_config(args, target, device, uses_llamacpp, uses_vllm)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_results_dir(out, config, {v.label: v.desc for v in variants})
    hf_logging.set_verbosity_error()
    stopped, interrupted, profile = run_and_profile(args, target, datasets, variants, out, engines)
    summary = report(args, out, datasets, variants, config, stopped, profile, target)
    if interrupted:
        return 130
    return 1 if summary["correctness"]["failed"] else 0
