"""`flashdraft export`: a drafter (or the target) as GGUF for llama.cpp."""

from __future__ import annotations

import sys

from ..llamacpp.build import OUTTYPES


def add_export(sub) -> None:
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
    from ..llamacpp.gguf import export_drafter, export_target

    if args.drafter is not None:
        out = export_drafter(args.drafter, args.gguf, args.target, args.outtype)
    else:
        out = export_target(args.target, args.gguf, args.outtype)
    print(f"flashdraft: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.outtype})", file=sys.stderr)
    return 0
