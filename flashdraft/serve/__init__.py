"""`flashdraft serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around one target and its drafter.

Only this module is imported by `flashdraft --help`; the web stack (the `serve` extra) loads when the command runs.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys

from ..errors import FlashdraftError
from ..decoding import settings_from_args

ENGINES = ("torch", "vllm")


def check_options(args) -> None:
    """One-line errors for options that cannot work, before anything is loaded."""
    if args.engine not in ENGINES:
        raise FlashdraftError(f"--engine {args.engine} does not serve: choose torch (flashdraft's own server) or vllm "
                              "(vLLM's server with flashdraft's speculative config)")
    if args.engine != "vllm" and (args.vllm_args or args.print_command):
        raise FlashdraftError("--vllm-args and --print-command are for --engine vllm")
    if not 0 <= args.port <= 65535:
        raise FlashdraftError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_queue",):
        if getattr(args, name) < 0:
            raise FlashdraftError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("max_batch", "prefill_chunk", "request_timeout", "shutdown_timeout", "max_body_bytes", "default_max_tokens",
                 "max_connections", "body_timeout"):
        if not getattr(args, name) > 0:
            raise FlashdraftError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.block_size is not None and args.block_size < 1:
        raise FlashdraftError(f"block size must be >= 1, got {args.block_size}")
    if args.engine == "vllm" and args.allowed_hosts:
        raise FlashdraftError("--allowed-hosts is for --engine torch (vLLM's server does not check the Host header)")
    if args.api_key is not None and not args.api_key.strip():
        raise FlashdraftError("--api-key is empty; give the key clients must send, or leave the flag out")
    for name in hosts_list(args):
        if "*" in name[1:] or (name.startswith("*") and name != "*" and not name.startswith("*.")):
            raise FlashdraftError(f"--allowed-hosts: {name!r} is not a host name (a wildcard may only start a name, "
                                  "as *.example.com)")


def hosts_list(args) -> list[str]:
    """--allowed-hosts as a list of lower-case names."""
    return [h.strip().lower() for h in (args.allowed_hosts or "").split(",") if h.strip()]


def api_key(args) -> str | None:
    """--api-key, else $FLASHDRAFT_API_KEY (as vLLM reads VLLM_API_KEY), else None."""
    return args.api_key or os.environ.get("FLASHDRAFT_API_KEY") or None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (IPv4 or IPv6 by the host's address family)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise FlashdraftError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def cmd_serve(args) -> int:
    check_options(args)
    if args.engine == "vllm":
        from .vllm import cmd_serve_vllm

        return cmd_serve_vllm(args, api_key(args))
    try:
        import uvicorn

        from .app import GracefulServer, allowed_hosts, create_app
    except ImportError as e:
        raise FlashdraftError(f"flashdraft serve needs the serve extra ({e.name} is missing): "
                              "pip install 'flashdraft[serve]'") from None
    import torch

    from ..models import load_drafter_or_plain, load_target, served_name
    from .engine import Engine
    from .protocol import Served
    from .scheduler import Limits, Scheduler

    settings = settings_from_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, dtype=args.dtype, device=device)
    drafter = load_drafter_or_plain(target, args.drafter, args.block_size)
    engine = Engine(target, drafter, settings, args.max_batch, adaptive=not args.fixed_block,
                    prefill_chunk=args.prefill_chunk)
    limits = Limits(args.max_queue, args.request_timeout, args.max_body_bytes, args.shutdown_timeout, args.body_timeout)
    scheduler = Scheduler(engine, limits)
    model_id = args.served_model_name or served_name(args.target)
    key, hosts = api_key(args), allowed_hosts(args.host, hosts_list(args))
    app = create_app(scheduler, Served([model_id], target, args.default_max_tokens, engine.tokens), key, hosts)

    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    policy = "fixed blocks" if args.fixed_block else "adaptive widths"
    print(f"flashdraft: serving {model_id!r} (block size {engine.block_size}, {policy}, max batch {engine.max_batch}, "
          f"{args.dtype}, {device}) on http://{url_host}:{port}/v1", file=sys.stderr, flush=True)
    if engine.max_batch < args.max_batch:
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

