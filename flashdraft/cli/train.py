"""`flashdraft prepare` and `flashdraft train` subcommands."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import FlashdraftError
from ..heap import bound_shape_caches
from ..train.config import TrainConfig


def add_train_commands(sub) -> None:
    """Register `prepare`, `train` and `draft-vocab` on the main parser's subcommands."""
    add_prepare(sub)
    add_train(sub)
    add_draft_vocab(sub)


def parse_int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FlashdraftError(f"{what} must be comma-separated integers, got {text!r}") from None


def set_threads(n: int | None) -> None:
    if n is not None:
        if n < 1:
            raise FlashdraftError(f"--threads must be >= 1, got {n}")
        from ..threads import pin

        pin(n)


# ---------------------------------------------------------------- prepare

def add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="generate drafter training data with the target itself",
                       description="Apply the target's chat template to prompts, let the target answer them and store "
                                   "token ids + response loss masks in resumable shards (flashdraft/train/data.py), or "
                                   "append them to a token store (--store, docs/data.md).")
    p.add_argument("out", help="output directory (re-running with the same settings resumes), or a token store")
    p.add_argument("--store", action="store_true",
                   help="OUT is a token store (e.g. data/tokens): compressed ids + manifest, appended to and resumed "
                        "prompt by prompt; implied when OUT already is one")
    p.add_argument("--store-cap-mib", type=float, default=64.0,  # train/store.py CAP_MIB
                   help="refuse to grow the token store beyond this many MiB (default 64: the repository keeps it)")
    p.add_argument("--prompts", action="append", default=[], metavar="[NAME=]FILE.jsonl",
                   help='JSONL with {"turns": [str, ...]} records (first turn used); repeat to mix files round-robin; '
                        "NAME (default: the file's stem) is the source's name in a token store")
    p.add_argument("--dataset", help="a Hugging Face datasets name instead of / besides --prompts (needs flashdraft[data])")
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--source", action="append", default=[], metavar="sharegpt[=FILE.json]",
                   help="a built-in source: sharegpt = ShareGPT V3 (needs flashdraft[sharegpt], or a FILE of that "
                        "format): every user turn of conversations that open with one, later turns with the "
                        "conversation before them (earlier answers from the data)")
    p.add_argument("--max-turns", type=int, default=0, metavar="N",
                   help="--source sharegpt: at most the first N user turns per conversation (default 0: all)")
    p.add_argument("--exclude", action="extend", nargs="+", default=[], metavar="FILE.jsonl",
                   help="drop prompts any user turn of which equals a text of these JSONL files (evaluation sets), "
                        "compared lowercased, without punctuation, whitespace collapsed")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="drop prompts longer than this (default: what fits the target's context with --max-new-tokens)")
    p.add_argument("--max-samples", type=int, help="use at most this many prompts (after mixing)")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch-size", type=int, default=64, help="prompts in flight at once")
    p.add_argument("--shard-size", type=int, default=256, help="prompts per shard (the unit of resumption)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="tokenize prompts as raw text, no chat template")
    p.add_argument("--features", action="store_true", help="also store the target's selected-layer features (bf16)")
    p.add_argument("--feature-layer-ids", help="comma-separated target layer ids for --features "
                   "(default: the drafter default for --num-layers)")
    p.add_argument("--num-layers", type=int, default=2, help="drafter layers the default feature layer ids are for")
    p.add_argument("--dev-percent", type=float, default=1.0,
                   help="hold out this %% of prompts (chosen by hash, stable across runs) as OUT/dev.jsonl: never "
                        "generated or trained on, used by `train --dev-prompts` to select checkpoints by real τ")
    p.add_argument("--part", default="0/1", metavar="I/N",
                   help="make only shards with index %% N == I (token store: prompts whose key is I mod N), so N "
                        "processes can fill one directory or store together")
    p.add_argument("--topk", type=int, default=0, metavar="K",
                   help="also store the target's K most likely tokens and log-probs per response token (distillation)")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a shared, busy machine)")
    p.add_argument("--prefix-cache-mib", type=float, default=2048.0,  # train/data.py PREFIX_CACHE_MIB
                   help="keep recent prompts' prefill K/V up to this many MiB, so a later turn of a conversation "
                        "prefills only its new part (the same tokens, bit for bit; default 2048, 0 = off)")
    p.set_defaults(func=cmd_prepare)


def check_prepare_args(args) -> tuple[list[int] | None, tuple[int, int]]:
    """The flags' ranges, before any file is read; returns (--feature-layer-ids, --part)."""
    from ..train.data import check_prepare_settings

    if not args.prompts and not args.dataset and not args.source:
        raise FlashdraftError("give prompts: --prompts FILE.jsonl (repeatable), --dataset NAME or --source sharegpt")
    if args.max_turns < 0:
        raise FlashdraftError(f"--max-turns must be >= 0 (0 = all), got {args.max_turns}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise FlashdraftError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if not args.prefix_cache_mib >= 0:
        raise FlashdraftError(f"--prefix-cache-mib must be >= 0 (0 = off), got {args.prefix_cache_mib}")
    if not args.store_cap_mib > 0:
        raise FlashdraftError(f"--store-cap-mib must be > 0, got {args.store_cap_mib}")
    if args.store and (args.features or args.topk):
        raise FlashdraftError("a token store keeps ids only (features and top-k are recomputed when training); "
                              "drop --features/--topk or prepare a directory without --store")
    if args.max_samples is not None and args.max_samples < 1:
        raise FlashdraftError(f"--max-samples must be >= 1, got {args.max_samples}")
    layer_ids = parse_int_list(args.feature_layer_ids, "--feature-layer-ids")
    if layer_ids is not None and not args.features:
        raise FlashdraftError("--feature-layer-ids needs --features")
    if args.num_layers < 1:
        raise FlashdraftError(f"--num-layers must be >= 1, got {args.num_layers}")
    if not 0 <= args.dev_percent < 100:
        raise FlashdraftError(f"--dev-percent must be in [0, 100), got {args.dev_percent}")
    try:
        part = tuple(int(x) for x in args.part.split("/"))
        assert len(part) == 2 and 0 <= part[0] < part[1]
    except (ValueError, AssertionError):
        raise FlashdraftError(f"--part must be I/N with 0 <= I < N, got {args.part!r}") from None
    check_prepare_settings(args.max_new_tokens, args.batch_size, args.shard_size, args.temperature, args.topk)
    return layer_ids, part


def cmd_prepare(args) -> int:
    from ..train.store import is_store

    set_threads(args.threads)
    bound_shape_caches()  # before the target loads: every prompt length is a new prefill shape
    args.store = args.store or is_store(args.out)
    layer_ids, part = check_prepare_args(args)
    if args.store and (Path(args.out) / "meta.json").is_file():
        raise FlashdraftError(f"{args.out} is a prepared data directory, not a token store; give --store a new path")
    sources = read_sources(args)
    return prepare_store_cmd(args, sources, part) if args.store else prepare_dir_cmd(args, sources, layer_ids, part)


def named_file(spec: str) -> tuple[str, str]:
    """--prompts [NAME=]FILE → (NAME or the file's stem, FILE)."""
    name, eq, file = spec.partition("=")
    if not eq or Path(spec).exists() or "/" in name:
        return Path(spec).stem, spec
    return name, file


def read_sources(args) -> list[tuple[str, list[tuple[int, object]]]]:
    """Every prompt source as (name, [(position in the source, prompt)]), evaluation texts (--exclude) dropped."""
    from ..train.data import read_dataset_prompts, read_jsonl_prompts
    from ..train.prompts import excluded, read_exclude, read_source

    out = [(name, read_jsonl_prompts(file)) for name, file in map(named_file, args.prompts)]
    if args.dataset:
        out.append((f"{args.dataset}-{args.dataset_split}".replace("/", "-"),
                    read_dataset_prompts(args.dataset, args.dataset_split, args.dataset_config)))
    for spec in args.source:
        name, prompts, line = read_source(spec, args.max_turns)
        print(f"flashdraft: {line}", file=sys.stderr)
        out.append((name, prompts))
    texts = read_exclude(args.exclude) if args.exclude else set()
    kept = [(name, [(i, p) for i, p in enumerate(prompts) if not (texts and excluded(p, texts))])
            for name, prompts in out]
    if args.exclude:
        dropped = {name: len(prompts) - len(k) for (name, prompts), (_, k) in zip(out, kept)}
        print(f"flashdraft: --exclude: {len(texts)} texts of {len(args.exclude)} file(s); dropped "
              + ", ".join(f"{n} {name}" for name, n in dropped.items()) + " prompts", file=sys.stderr)
    return kept


def load_prepare_target(args):
    import torch

    from ..models import load_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return load_target(args.target, dtype=args.dtype, device=device)


def prepare_dir_cmd(args, sources, layer_ids, part) -> int:
    """prepare OUT: a prepared data directory (flashdraft-data-v1)."""
    from .. import target as T
    from ..config import default_target_layer_ids
    from ..train.data import human_bytes, interleave, prepare, split_dev
    from ..train.prompts import encode_prompt

    prompts, dev = split_dev(interleave([[p for _, p in items] for _, items in sources]), args.dev_percent)
    target = load_prepare_target(args)
    limit = T.context_limit(target.model) - args.max_new_tokens
    limit = min(limit, args.max_prompt_tokens) if args.max_prompt_tokens else limit
    kept, dropped = [], 0
    for p in prompts:  # tokenized one by one: only as many as --max-samples needs
        if args.max_samples is not None and len(kept) >= args.max_samples:
            break
        if len(encode_prompt(target, p, not args.no_chat)) <= limit:
            kept.append(p)
        else:
            dropped += 1
    if args.features and layer_ids is None:
        layer_ids = default_target_layer_ids(target.model.config.get_text_config().num_hidden_layers, args.num_layers)
    print(f"flashdraft: {len(kept)} prompts from {len(sources)} source(s) → {args.out}"
          f"{f' ({len(dev)} held out in dev.jsonl)' if dev else ''}"
          f"{f'; dropped {dropped} longer than {limit} prompt tokens' if dropped else ''}", file=sys.stderr)
    names = [*args.prompts, *([f"datasets:{args.dataset}:{args.dataset_split}"] if args.dataset else []), *args.source]
    s = prepare(target, kept, args.out, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                batch_size=args.batch_size, shard_size=args.shard_size, seed=args.seed,
                feature_layer_ids=layer_ids if args.features else None, chat=not args.no_chat, sources=names,
                topk=args.topk, part=part, dev=dev, prefix_cache_mib=args.prefix_cache_mib)
    rate = (f", {s['tokens_per_s']:.1f} generated tok/s over {s['seconds']:.0f} s this run"
            if s["generated_tokens_this_run"] else "")
    print(f"flashdraft: {s['sequences']} sequences ({s['unfinished']} cut at --max-new-tokens), {s['tokens']} tokens "
          f"({s['response_tokens']} response), {human_bytes(s['disk_bytes'])} on disk{rate}", file=sys.stderr)
    return 0


def prepare_store_cmd(args, sources, part) -> int:
    """prepare STORE --store: append the answers of prompts not yet in the token store."""
    from ..train.data import in_dev_split
    from ..train.store import Source, check_sources, describe, prepare_store

    srcs = [Source(name, [(i, p) for i, p in items if not in_dev_split(p, args.dev_percent)],
                   [p for _, p in items if in_dev_split(p, args.dev_percent)]) for name, items in sources]
    check_sources(srcs)  # before the target loads
    target = load_prepare_target(args)
    s = prepare_store(target, srcs, args.out, max_samples=args.max_samples, max_prompt_tokens=args.max_prompt_tokens,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=args.batch_size,
                      shard_size=args.shard_size, seed=args.seed, chat=not args.no_chat,
                      part=part, cap_mib=args.store_cap_mib, prefix_cache_mib=args.prefix_cache_mib)
    print(f"flashdraft: {describe(s, Path(args.out), args.store_cap_mib)}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- train

def add_train(sub) -> None:
    d = TrainConfig(data="", out="")
    p = sub.add_parser("train", help="train a DFlash drafter on prepared data",
                       description="Train a block-diffusion drafter against a frozen target (docs/design.md §4). "
                                   "Multi-GPU / multi-process: torchrun --nproc_per_node=N -m flashdraft.cli train ...")
    p.add_argument("--data", required=True, action="append", metavar="DIR",
                   help="directory written by flashdraft prepare, or a token store such as data/tokens (repeatable: "
                        "train on several together; dev τ uses their dev prompts interleaved unless --dev-prompts)")
    p.add_argument("--data-source", action="append", metavar="NAME",
                   help="token stores: train on this source's shards only (repeatable; default: all sources)")
    p.add_argument("--out", required=True, help="checkpoint directory (step_N/ are z-lab drafters, usable as --drafter)")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--init-from", help="start from this drafter directory instead of random weights")
    p.add_argument("--num-layers", type=int, default=None,
                   help="drafter layers: a new drafter's (default 2); with --init-from keep its first N, or grow it to N with "
                        "appended layers that start as the identity (default: as it is)")
    p.add_argument("--block-size", type=int, default=None, help="block size B (default 16, or --init-from's)")
    p.add_argument("--mask-token-id", type=int, help="mask token id (default: spare embedding row, else the "
                   "highest-id unused special token, e.g. <empty_output>=16 for SmolLM2)")
    add_optimizer_arguments(p, d)
    add_run_arguments(p, d)
    add_variant_arguments(p, d)
    p.add_argument("--device", default=None, help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    p.set_defaults(func=cmd_train)


def add_optimizer_arguments(p, d) -> None:
    """train: steps, batches, the optimizer, the loss and dtypes (d: the TrainConfig defaults)."""
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step over all processes")
    p.add_argument("--micro-batch", type=int, help="sequences per forward per process (gradient accumulation)")
    p.add_argument("--anchors", type=int, default=d.anchors, help="max anchor blocks per sequence per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor as a fraction of --lr")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 4%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--gamma", type=float, help="loss decay γ (default 7/5/4 for B=16/10/8, else (B+5)/3)")
    p.add_argument("--kl-weight", type=float, default=d.kl_weight, help="add this times KL(target || drafter)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype, help="compute dtype (weights stay fp32)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default=d.save_dtype, help="dtype of model.safetensors")
    p.add_argument("--offline", action="store_true", help="use features stored by prepare --features")


def add_run_arguments(p, d) -> None:
    """train: evaluation, checkpoints, resuming, stopping and dev τ."""
    p.add_argument("--eval-sequences", type=int, default=d.eval_sequences, help="held-out sequences (at most 10%%)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--keep-last", type=int, default=d.keep_last, help="checkpoints to keep")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/latest (bit-for-bit)")
    p.add_argument("--extend", action="store_true",
                   help="with --resume: also accept data that has grown since the run started and a larger --steps "
                        "(not bit-for-bit: the data order continues over the new set)")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this many steps in this run")
    p.add_argument("--time-limit", type=float, metavar="MIN",
                   help="stop (with a checkpoint) once this run has trained for MIN minutes")
    p.add_argument("--dev-prompts", metavar="FILE.jsonl",
                   help="held-out prompts for checkpoint selection by real speculative-decoding τ (float32, greedy); "
                        "default: every DATA/dev.jsonl prepare wrote, interleaved. The best drafter is kept in OUT/best")
    p.add_argument("--dev-samples", type=int, default=d.dev_samples, help="dev prompts decoded per evaluation")
    p.add_argument("--dev-max-new-tokens", type=int, default=d.dev_max_new_tokens)
    p.add_argument("--dev-every", type=int, help="steps between dev τ evaluations (default: --save-every; 0 = never)")


def add_variant_arguments(p, d) -> None:
    """train: distillation, vocabularies, DFlash 2, DLoop, warm starts."""
    p.add_argument("--distill-weight", type=float, default=d.distill_weight,
                   help="offline distillation: add this times the cross-entropy against the target's top-k "
                        "distribution stored by prepare --topk (renormalised over the k tokens)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, metavar="N",
                   help="checkpoints propose only the N most frequent response tokens of the data (draft_vocab.json; "
                        "lossless, and a much cheaper draft head on CPU); 0 = the whole vocabulary")
    p.add_argument("--selector-gold", action="store_true",
                   help="DFlash 2: where the true token is not among the candidates, it replaces the weakest one in "
                        "the selector loss (default: such positions are skipped)")
    p.add_argument("--arch", choices=["dflash", "dflash2"], help="drafter kind (default: dflash, or the --init-from "
                   "drafter's; dflash2 with a DFlash 1 --init-from starts exactly equal to it)")
    p.add_argument("--selector-rank", type=int, help="DFlash 2 candidate-selector rank (default 256)")
    p.add_argument("--selector-top-k", type=int, help="DFlash 2 candidates per position (default 16)")
    p.add_argument("--selector-weight", type=float, default=d.selector_weight,
                   help="DFlash 2: weight of the selector loss added to the block loss")
    p.add_argument("--loop-stages", type=int, default=d.loop_stages, metavar="S",
                   help="DLoop-aware training: each step also trains one later stage s in 2..S (drafting positions "
                        "(s-1)(B-1)+1..s(B-1) from the revealed true prefix); loss = (stage 1 + stage s) / 2")
    p.add_argument("--target-init", action="store_true",
                   help="warm-start a new drafter's layers from the target's last layers and fc from its last feature "
                        "layer (needs equal layer shapes); the final norm always starts as the target's")
    p.add_argument("--loss-vocab", type=int, default=d.loss_vocab, metavar="N",
                   help="sampled softmax over the N most frequent training tokens, the step's labels and N/4 random "
                        "ids (several times faster on CPU; evaluation stays full-vocabulary); 0 = full vocabulary")
    p.add_argument("--loss-chunk", type=int, default=d.loss_chunk, help="logit rows per checkpointed loss chunk")


def cmd_train(args) -> int:
    from ..train.trainer import train

    set_threads(args.threads)
    keys = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in keys})
    if len(cfg.data) == 1:
        cfg.data = cfg.data[0]  # one directory stays a string, as runs made before several were allowed store it
    try:
        if train(cfg, log=print).interrupted:
            return 130  # like an interrupted shell job: a wrapper loop stops instead of starting the next chunk
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- draft-vocab

def add_draft_vocab(sub) -> None:
    p = sub.add_parser("draft-vocab", help="let a drafter propose only the N most frequent tokens of prepared data",
                       description="Write DRAFTER/draft_vocab.json: the N most frequent response tokens of DATA. "
                                   "Decoding stays lossless; the drafter's LM head shrinks to N rows. Delete the file "
                                   "to propose from the whole vocabulary again.")
    p.add_argument("drafter", help="drafter directory (changed in place)")
    p.add_argument("--data", required=True, action="append", metavar="DIR",
                   help="directory written by flashdraft prepare (repeatable)")
    p.add_argument("--size", type=int, required=True, metavar="N")
    p.set_defaults(func=cmd_draft_vocab)


def cmd_draft_vocab(args) -> int:
    from ..atomic import write_text
    from ..checkpoint import DRAFT_VOCAB, draft_vocab_json
    from ..config import load_config
    from ..train.batches import frequent_tokens
    from ..train.store import load_data

    if args.size < 1:
        raise FlashdraftError(f"--size must be >= 1, got {args.size}")
    drafter_config = load_config(Path(args.drafter))
    ids = frequent_tokens(load_data(args.data), args.size, drafter_config.vocab_size)
    if int(ids.max()) >= drafter_config.vocab_size:
        raise FlashdraftError(f"{' + '.join(args.data)} holds token ids beyond the drafter's vocabulary; "
                              "it was made for another target")
    write_text(Path(args.drafter) / DRAFT_VOCAB, draft_vocab_json(ids))
    print(f"flashdraft: {args.drafter} now proposes from {len(ids)} of {drafter_config.vocab_size} tokens", file=sys.stderr)
    return 0
