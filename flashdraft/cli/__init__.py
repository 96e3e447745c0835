"""`flashdraft …` command line: one module per command (generate, bench, load, export, serve, train, trace), argparse only.

Each command module has add_<command>(subparsers) and cmd_<command>(args); heavy imports wait until a command runs.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import FlashdraftError
from .bench import add_bench
from .export import add_export
from .generate import add_generate
from .load import add_load
from .serve import add_serve
from .trace import add_trace
from .train import add_train_commands

NEGATIVE_VALUED = ("--loop-gate",)  # options whose values may start with '-' ("-inf", "-0.5,-1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description="Lossless speculative decoding with DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_train_commands(sub)
    add_bench(sub)
    add_serve(sub)
    add_load(sub)
    add_export(sub)
    add_trace(sub)
    return parser


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
