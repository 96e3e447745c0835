"""Bench variants: each method once, drafter methods per (drafter, block size, DLoop setting, lookup, tree), llama.cpp
methods per target file and vLLM methods per batch size, each with a stable label and a description recorded in
run.json."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..engines import get_engine
from ..engines.llamacpp import server_context
from ..errors import FlashdraftError
from ..llamacpp.gguf import Gguf
from ..models import load_drafter_for
from .methods import DRAFTER_METHODS, LLAMACPP_METHODS, MLX_METHODS, VLLM_METHODS, MethodSettings

LOOKUP_LABELS = {True: "lookup", False: "no-lookup", "tree": "lookup-tree"}


@dataclass
class Variant:
    label: str
    method: str
    settings: MethodSettings
    desc: dict


@dataclass
class Sweep:
    """What the drafter methods run over (each list in the order given, repeats dropped by the caller)."""

    drafters: list[str | None] = field(default_factory=lambda: [None])  # None: the target's registered drafter
    block_sizes: list[int] = field(default_factory=list)  # []: each drafter's own
    loops: list[tuple[int, float]] = field(default_factory=lambda: [(1, -0.75)])  # (DLoop stages, gate)
    lookups: list[bool | str] = field(default_factory=lambda: [True])
    trees: list[int | None] = field(default_factory=lambda: [None])  # None: the default for the loop setting
    ggufs: list[Gguf] = field(default_factory=list)  # target files of the llama.cpp methods
    threads: int | None = None  # llama.cpp threads (default all cores)
    batches: list[int] = field(default_factory=lambda: [1])  # prompts the vllm methods decode together


def loop_settings(stages: list[int], gates: list[float]) -> list[tuple[int, float]]:
    """(stages, gate) pairs to sweep: stages 1 is plain DFlash once (the gate never matters there)."""
    pairs = [(1, gates[0])] if 1 in stages else []
    return pairs + [(s, g) for s in dict.fromkeys(stages) if s > 1 for g in dict.fromkeys(gates)]


def variant_label(m: str, kind: str, parts: list[str]) -> str:
    """`dflash2[name,b8,s2,g-0.75]`, `llamacpp-dflash2[f32,name,b8]`: drafter methods are labelled by drafter kind."""
    head = m.removesuffix("dflash") + kind if m in DRAFTER_METHODS else m  # llamacpp-dflash → llamacpp-dflash2
    return f"{head}[{','.join(parts)}]" if parts else head


def torch_variants(m: str, kind: str, parts: list[str], desc: dict, base: MethodSettings,
                   sweep: Sweep) -> list[Variant]:
    """One dflash Variant per (loop setting, lookup, tree) at one drafter and block size."""
    out = []
    for (stages, gate), lookup, asked in itertools.product(sweep.loops, sweep.lookups, sweep.trees):
        decode = base.decode.updated(loop_stages=stages, loop_gate=gate, lookup=lookup, tree=asked).validate()
        tree = decode.resolve(None).tree
        default_tree = decode.updated(tree=None).resolve(None).tree
        label_parts, vdesc = list(parts), {**desc, "lookup": lookup, "tree": tree}
        if stages > 1:
            label_parts += [f"s{stages}", f"g{gate:g}"]
            vdesc |= {"loop_stages": stages, "loop_gate": gate}
        if len(sweep.lookups) > 1 or lookup is not True:  # on is the default and goes unlabelled alone
            label_parts.append(LOOKUP_LABELS[lookup])
        if len(sweep.trees) > 1 or tree != default_tree:  # the default goes unlabelled alone
            label_parts.append(f"tree{tree}" if tree else "chain")
        out.append(Variant(variant_label(m, kind, label_parts), m, replace(base, decode=decode.updated(tree=tree)),
                           vdesc))
    return out


def vllm_variants(target, m: str, drafter: str | None, base: MethodSettings, sweep: Sweep, kind: str,
                  parts: list[str], desc: dict, engines: list) -> list[Variant]:
    """One vLLM Variant per batch size (plain when drafter is None and m is vllm); engines start at their first
    request and are appended to `engines`."""
    out = []
    for b in sweep.batches:
        bs = [f"bs{b}"] if len(sweep.batches) > 1 or b != 1 else []
        engine = get_engine("vllm").open(target, drafter, base.decode, plain=m == "vllm")
        engines.append(engine)
        vdesc = {**desc, "method": m, "batch": b}
        if m != "vllm":
            vdesc["baseline"] = variant_label("vllm", "", bs)
        out.append(Variant(variant_label(m, kind, parts + bs), m, replace(base, engine=engine, batch=b), vdesc))
    return out


def mlx_variants(target, m: str, drafter: str | None, base: MethodSettings, sweep: Sweep, kind: str,
                 parts: list[str], desc: dict, engines: list) -> list[Variant]:
    """mlx: the target alone in MLX; mlx-dflash: one Variant per lookup setting (the MLX engine verifies chains, so
    trees are not swept), baseline mlx."""
    if m == "mlx":
        engine = get_engine("mlx").open(target, plain=True)
        engines.append(engine)
        return [Variant("mlx", m, replace(base, engine=engine), {"method": m})]
    engine = get_engine("mlx").open(target, drafter, base.decode.updated(tree=None))
    engines.append(engine)
    out = []
    for lookup in sweep.lookups:
        label_parts = parts + ([LOOKUP_LABELS[lookup]] if len(sweep.lookups) > 1 or lookup is not True else [])
        decode = base.decode.updated(lookup=lookup, tree=0)
        out.append(Variant(variant_label(m, kind, label_parts), m, replace(base, decode=decode, engine=engine),
                           {**desc, "method": m, "lookup": lookup, "baseline": "mlx"}))
    return out


def drafter_variants(target, m: str, base: MethodSettings, sweep: Sweep, gguf: Gguf | None,
                     engines: list) -> list[Variant]:
    """One Variant per (drafter, block size, loop setting, lookup, tree) of a drafter method; on llama.cpp per target
    file instead of per lookup and tree setting (llama.cpp drafts a chain every cycle)."""
    out = []
    for d in sweep.drafters:
        drafter = load_drafter_for(target, d)
        if drafter is None:
            raise FlashdraftError(f"method {m} needs a drafter and none is registered for {target.name}: "
                                  "pass --drafter DIR (or train one with `flashdraft train`)")
        kind, name = drafter.config.arch, Path(d).name if d else "registered"
        for b in sweep.block_sizes or [drafter.config.block_size]:
            if b < 2:
                raise FlashdraftError(f"--block-size {b}: {m} needs a block size >= 2 (block size 1 is `ar`)")
            desc = {"method": m, "drafter": str(Path(d).resolve()) if d else name, "kind": kind, "block_size": b}
            parts = [] if len(sweep.drafters) == 1 and len(sweep.block_sizes) <= 1 else [name, f"b{b}"]
            decode = base.decode.updated(block_size=b)
            if m in VLLM_METHODS:
                out += vllm_variants(target, m, d, replace(base, decode=decode), sweep, kind, parts, desc, engines)
                continue
            if m in MLX_METHODS:
                out += mlx_variants(target, m, d, replace(base, decode=decode), sweep, kind, parts, desc, engines)
                continue
            if gguf is None:
                out += torch_variants(m, kind, parts, desc, replace(base, decode=decode, drafter=drafter), sweep)
                continue
            engine = get_engine("llamacpp").open(target, d, decode, gguf=gguf, threads=sweep.threads,
                                                 ctx=server_context(target))
            engines.append(engine)
            desc |= {"gguf": str(gguf.path), "baseline": variant_label("llamacpp", "", [gguf.label])}
            out.append(Variant(variant_label(m, kind, [gguf.label] + parts), m,
                               replace(base, decode=decode, engine=engine), desc))
    return out


def build_variants(target, methods: list[str], base: MethodSettings, sweep: Sweep,
                   engines: list | None = None) -> list[Variant]:
    """One Variant per method, per (drafter, block size, loop setting, lookup, tree) for drafter methods and per
    target file for llama.cpp methods; stable labels. llama.cpp engines are opened (their servers start at the first
    request) and appended to `engines`, for the caller to close."""
    engines = [] if engines is None else engines
    out = []
    for m in methods:
        for g in list(sweep.ggufs) if m in LLAMACPP_METHODS else [None]:
            if m in DRAFTER_METHODS:
                out += drafter_variants(target, m, base, sweep, g, engines)
            elif m in VLLM_METHODS:
                out += vllm_variants(target, m, None, base, sweep, "", [], {}, engines)
            elif m in MLX_METHODS:
                out += mlx_variants(target, m, None, base, sweep, "", [], {}, engines)
            elif g is not None:
                engine = get_engine("llamacpp").open(target, plain=True, gguf=g, threads=sweep.threads,
                                                     ctx=server_context(target))
                engines.append(engine)
                out.append(Variant(variant_label(m, "", [g.label]), m, replace(base, engine=engine),
                                   {"method": m, "gguf": str(g.path)}))
            else:
                out.append(Variant(m, m, base, {"method": m}))
    labels = [v.label for v in out]
    if len(set(labels)) != len(labels):
        raise FlashdraftError(f"two method variants share a label ({labels}); give drafters distinct folder names")
    return out
