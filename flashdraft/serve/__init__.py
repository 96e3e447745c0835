"""`flashdraft serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) around one target and its drafter.

server.py     the server put together (target, worker, scheduler, app) and run on a bound socket
worker.py     the decoding side: requests join and leave one batch at cycle boundaries (no web code)
scheduler.py  admission, queueing, limits and metrics
app.py        the FastAPI app: routes, streaming, errors, access checks
protocol.py   the OpenAI request and response shapes
vllm.py       `--engine vllm`: vLLM's own server with flashdraft's speculative config
The command line (flags, their checks, the choice of server) is flashdraft/cli/serve.py. This package face holds only
the socket helpers, so that importing flashdraft.serve.vllm (vLLM's server imports its middleware) or bench/load.py
loads neither torch nor the web stack.
"""

from __future__ import annotations

import ipaddress
import socket

from ..errors import FlashdraftError


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at host now (for servers that take no --port 0, as vLLM's)."""
    with socket.create_server((host, 0)) as s:
        return s.getsockname()[1]
