"""`flashdraft serve`: its flags, their checks, and the server the engine runs (flashdraft's own, flashdraft/serve/,
or vLLM's); the server, torch and the web stack load only once the flags have passed."""

from __future__ import annotations

import os

from ..decoding.settings import PREFILL_CHUNK, add_decode_arguments
from ..engines import check_serves, get_server
from ..errors import FlashdraftError
from ..heap import bound_shape_caches

SERVE_EXTRA = ("fastapi", "uvicorn", "pydantic", "prometheus_client", "starlette")  # pip install 'flashdraft[serve]'
# flags only flashdraft's own server has (attribute → flag)
TORCH_ONLY = {"fixed_block": "--fixed-block", "tree": "--tree", "lookup": "--lookup", "no_lookup": "--no-lookup"}


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (chat / completions, streaming)",
                       description="Serve the target with speculative decoding behind the OpenAI API: "
                                   "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.")
    p.add_argument("--target", help="registered name, local HF model dir or hub id (default: smollm2-135m-instruct)")
    p.add_argument("--drafter", help="drafter directory (z-lab format); default: the one registered for the target")
    # free text, not argparse choices: check_options names the engines that serve in its one-line error
    p.add_argument("--engine", default="torch",
                   help="torch (default): flashdraft's own server; vllm: vLLM's OpenAI server (`make vllm`) with the "
                        "drafter as its DFlash speculator, num_speculative_tokens from --block-size or derived")
    p.add_argument("--vllm-args", help="--engine vllm: more `vllm serve` arguments, passed as given (e.g. "
                                       "\"--tensor-parallel-size 2\")")
    p.add_argument("--print-command", action="store_true",
                   help="--engine vllm: print the `vllm serve` command line and exit (nothing is started)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: pick a free one; the bound port is printed)")
    p.add_argument("--served-model-name", help="model id clients must send (default: the target's name)")
    add_decode_arguments(p, per_request=False)  # length, sampling and stops come with each request
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int,
                   help="CPU threads for torch (default: every core while the machine is free, only the cores other "
                        "processes leave while they hold some; docs/performance.md)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="requests decoded together: each joins the batch at a cycle boundary and leaves when done "
                        "(default 8; 1 = one at a time; vLLM's --max-num-seqs)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per prefill pass: a longer prompt joins over several cycles, so the streams "
                        f"already decoding stall for one chunk at a time, not the whole prefill (default "
                        f"{PREFILL_CHUNK})")
    p.add_argument("--prefix-cache-mib", type=float, default=1024.0,
                   help="keep recent prompts' whole prefill chunks (K/V and drafter features) up to this many MiB, so a "
                        "prompt that extends one (the next turn of a chat, a shared system prompt) prefills only the "
                        "rest; outputs are bit for bit the same (default 1024, 0 = off)")
    p.add_argument("--fixed-block", action="store_true",
                   help="verify each request's full block every cycle (default: greedy requests' widths adapt to the "
                        "measured load, docs/adaptive.md); its cycles then equal flashdraft generate's")
    p.add_argument("--max-queue", type=int, default=8,
                   help="requests that may wait while the batch is full; more get 429 (default 8)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds from admission to the last token, waiting included (default 300)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 (default 1 MiB)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens when a request gives none (default 256, capped by the context)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="after SIGTERM, seconds admitted requests get to finish before they are cancelled (default 30)")
    p.add_argument("--api-key", help="require the header Authorization: Bearer KEY on every route but /health (401 "
                                     "without it); default: $FLASHDRAFT_API_KEY, else no key")
    p.add_argument("--allowed-hosts",
                   help="comma-separated Host header names the server also answers, e.g. myhost.lan,10.0.0.5 (default: "
                        "localhost, 127.0.0.1, [::1] and the --host address; any name when --host is 0.0.0.0 or ::); "
                        "other Host headers get 400, which keeps DNS-rebinding pages out")
    p.add_argument("--max-connections", type=int, default=128,
                   help="concurrent connections beyond which new ones get 503 (default 128; uvicorn's "
                        "limit_concurrency)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its request body; past that 408 (default 30)")
    p.set_defaults(func=cmd_serve)


def check_options(args) -> None:
    """One-line errors for options that cannot work, before anything is loaded."""
    check_serves(args.engine)
    if args.engine != "vllm" and (args.vllm_args or args.print_command):
        raise FlashdraftError("--vllm-args and --print-command are for --engine vllm")
    if not 0 <= args.port <= 65535:
        raise FlashdraftError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_queue", "prefix_cache_mib"):
        if getattr(args, name) < 0:
            raise FlashdraftError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("max_batch", "prefill_chunk", "request_timeout", "shutdown_timeout", "max_body_bytes", "default_max_tokens",
                 "max_connections", "body_timeout"):
        if not getattr(args, name) > 0:
            raise FlashdraftError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.block_size is not None and args.block_size < 1:
        raise FlashdraftError(f"block size must be >= 1, got {args.block_size}")
    if args.threads is not None and args.threads < 1:
        raise FlashdraftError(f"--threads must be >= 1, got {args.threads}")
    if args.engine == "vllm" and args.allowed_hosts:
        raise FlashdraftError("--allowed-hosts is for --engine torch (vLLM's server does not check the Host header)")
    if args.api_key is not None and not args.api_key.strip():
        raise FlashdraftError("--api-key is empty; give the key clients must send, or leave the flag out")
    for name in hosts_list(args):
        if "*" in name[1:] or (name.startswith("*") and name != "*" and not name.startswith("*.")):
            raise FlashdraftError(f"--allowed-hosts: {name!r} is not a host name (a wildcard may only start a name, "
                                  "as *.example.com)")
    if args.engine == "vllm":
        check_vllm_options(args)


def check_vllm_options(args) -> None:
    """One-line errors for flags only flashdraft's own server has."""
    for name, flag in TORCH_ONLY.items():
        if getattr(args, name, None) not in (None, False):
            raise FlashdraftError(f"{flag} is for --engine torch (vLLM's server verifies a chain every cycle); drop it")
    if getattr(args, "loop_stages", 1) not in (None, 1):
        raise FlashdraftError("--loop-stages (DLoop) is for --engine torch; drop it")
    if getattr(args, "threads", None) is not None:
        raise FlashdraftError("--threads is for --engine torch (vLLM's CPU build takes VLLM_CPU_OMP_THREADS_BIND); "
                              "drop it")


def hosts_list(args) -> list[str]:
    """--allowed-hosts as a list of lower-case names."""
    return [h.strip().lower() for h in (args.allowed_hosts or "").split(",") if h.strip()]


def api_key(args) -> str | None:
    """--api-key, else $FLASHDRAFT_API_KEY (as vLLM reads VLLM_API_KEY), else None."""
    return args.api_key or os.environ.get("FLASHDRAFT_API_KEY") or None


def cmd_serve(args) -> int:
    check_options(args)
    bound_shape_caches()  # before the target loads: a server meets every prompt length and batch shape
    try:
        run = get_server(args.engine)  # the engine registry's server for --engine, imported now
    except ImportError as e:
        if (e.name or "").split(".")[0] not in SERVE_EXTRA:
            raise
        raise FlashdraftError(f"flashdraft serve needs the serve extra ({e.name} is missing): "
                              "pip install 'flashdraft[serve]'") from None
    return run(args, api_key(args), hosts_list(args))
