"""Screenshot a trace page in headless Chromium (how docs/trace.png is made).

    flashdraft generate "<prompt>" --max-new-tokens 128 --json > rec.json
    flashdraft trace rec.json -o trace.html
    python scripts/trace_screenshot.py trace.html docs/trace.png --pin 7

Needs playwright (the dev extra) and a Chromium (Debian: apt-get install chromium); no browser download.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("page", help="trace HTML file")
    p.add_argument("png", help="output PNG")
    p.add_argument("--pin", type=int, help="click this cycle first, so its details show")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args()
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=args.chromium, args=ARGS, headless=True,
                                                    viewport={"width": args.width, "height": 600})
        page = ctx.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(Path(args.page).resolve().as_uri())
        if args.pin is not None:
            page.click(f'[data-cycle="{args.pin}"]')
            page.mouse.move(0, 0)
        page.screenshot(path=args.png, full_page=True)
        ctx.close()
    for e in errors:
        print(f"console error: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
