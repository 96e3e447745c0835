"""flashdraft's own server put together: the target and drafter, the worker that decodes their batch, the scheduler,
the app, and uvicorn on a bound socket. The command line (checks, --engine vllm) is flashdraft/cli/serve.py."""

from __future__ import annotations

import logging
import sys

import torch
import uvicorn

from ..decoding import settings_from_args
from ..models import load_drafter_or_plain, load_target, served_name
from ..threads import hand_over
from ..threads import pin as pin_threads
from . import bind, is_loopback
from .app import GracefulServer, allowed_hosts, create_app
from .protocol import Served
from .scheduler import Limits, Scheduler
from .worker import Worker  # the one place the server names the decoding side it runs


def run_server(args, key: str | None, hosts: list[str]) -> int:
    """Load, listen on --host/--port and serve until SIGTERM or Ctrl-C (the flags checked by flashdraft/cli/serve.py;
    key: the API key; hosts: the Host names answered besides the bind's, --allowed-hosts)."""
    settings = settings_from_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        pin_threads(args.threads)
    threads = hand_over()  # only the decode thread runs parallel ops (threads.py): this one loads on one thread
    target = load_target(args.target, dtype=args.dtype, device=device)
    drafter = load_drafter_or_plain(target, args.drafter, args.block_size)
    worker = Worker(target, drafter, settings, args.max_batch, adaptive=not args.fixed_block,
                    prefill_chunk=args.prefill_chunk, threads=threads, prefix_cache_mib=args.prefix_cache_mib)
    limits = Limits(args.max_queue, args.request_timeout, args.max_body_bytes, args.shutdown_timeout, args.body_timeout)
    scheduler = Scheduler(worker, limits)
    model_id = args.served_model_name or served_name(args.target)
    app = create_app(scheduler, Served([model_id], target, args.default_max_tokens, worker.tokens), key,
                     allowed_hosts(args.host, hosts))

    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    policy = "fixed blocks" if args.fixed_block else "adaptive widths"
    print(f"flashdraft: serving {model_id!r} (block size {worker.block_size}, {policy}, max batch {worker.max_batch}, "
          f"{args.dtype}, {device}) on http://{url_host}:{port}/v1", file=sys.stderr, flush=True)
    if worker.max_batch < args.max_batch:
        print("flashdraft: note: the target has sliding-window layers, which cannot be batched: decoding one request "
              "at a time", file=sys.stderr)
    if not is_loopback(args.host) and key is None:
        print("flashdraft: warning: listening beyond loopback without --api-key: anyone who can reach the port may "
              "use the server", file=sys.stderr)
    # the tracebacks of failed requests go to stderr (clients get only the request id)
    logging.basicConfig(format="flashdraft: %(levelname)s: %(message)s", level=logging.WARNING)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=limits.shutdown_timeout + 5,
                            limit_concurrency=args.max_connections)
    GracefulServer(config, scheduler).run(sockets=[sock])
    print("flashdraft: server stopped", file=sys.stderr, flush=True)
    return 0
