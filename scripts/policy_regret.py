"""How close the adaptive policy came to the better choice, from a run's own cycles: for each batch size, the tokens
per second achieved against the better of that run's plain cycles and speculative cycles (time-weighted; a choice
needs 5 cycles to count). Free of the drift between separate runs that a comparison of whole runs carries.

    FLASHDRAFT_CYCLE_LOG=cycles.jsonl flashdraft load --modes adaptive …   (or serve, or generate_batch)
    python scripts/policy_regret.py cycles.jsonl
"""

from __future__ import annotations

import argparse
import json


def regret(cycles: list[dict], min_cycles: int = 5) -> dict:
    """{rows: {plain, speculative: [seconds, tokens, cycles], achieved, best, ratio}} and 'overall': the tokens of
    the run over those the better choice of each batch size would have made in the same time."""
    sizes: dict[int, dict[bool, list[float]]] = {}
    for c in cycles:
        t = sizes.setdefault(c["rows"], {False: [0.0, 0, 0], True: [0.0, 0, 0]})[c["width"] > 1]
        t[0], t[1], t[2] = t[0] + c["seconds"], t[1] + c["tokens"], t[2] + 1
    out, tokens, best_tokens = {}, 0, 0.0
    for n, by in sorted(sizes.items()):
        seconds, made = sum(v[0] for v in by.values()), sum(v[1] for v in by.values())
        rates = [v[1] / v[0] for v in by.values() if v[2] >= min_cycles and v[0] > 0]
        best = max(rates) if rates else made / seconds
        out[n] = {"plain": by[False], "speculative": by[True], "achieved": made / seconds, "best": best,
                  "ratio": made / seconds / best}
        tokens, best_tokens = tokens + made, best_tokens + best * seconds
    out["overall"] = tokens / best_tokens if best_tokens else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", nargs="+", help="FLASHDRAFT_CYCLE_LOG files")
    for path in ap.parse_args().log:
        with open(path) as f:
            r = regret([json.loads(line) for line in f if line.strip()])
        print(path)
        for n, v in r.items():
            if n != "overall":
                print(f"  {n} rows: cycles plain {v['plain'][2]} / speculative {v['speculative'][2]}, "
                      f"{v['achieved']:.1f} tok/s of the better choice's {v['best']:.1f}: {v['ratio']:.3f}")
        print(f"  overall: {r['overall']:.3f}")


if __name__ == "__main__":
    main()
