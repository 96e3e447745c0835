"""Trace pages (flashdraft/trace.py, trace_cli.py): structure via html.parser, then the page in a real browser."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from functools import lru_cache
from html.parser import HTMLParser

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.trace import bench_turn, build_cycles, render, write_trace
from flashdraft.cli.trace import add_trace, lowest_tau, trace_bench, trace_for_generate
from helpers import hf_greedy, tiny_target, tiny_tokenizer
from lossless import generate_drafted, oracle_proposer


def words(tok: int) -> str:
    return f"t{tok} "


# A hand-written record: a chain that fails at its 3rd draft (target 7 instead of 3), a tree kept along its main
# branch until node 3 is rejected (target 90), a tree kept along a side branch to a leaf (bonus 40), a lookup cycle
# kept whole (bonus 43), and a last cycle cut by the length limit inside its kept drafts.
HAND = {
    "output_ids": [5, 1, 2, 7, 10, 11, 90, 21, 22, 40, 41, 42, 43, 50],
    "text": "", "num_prompt_tokens": 9, "num_new_tokens": 14, "acceptance_lengths": [3, 3, 3, 3, 2],
    "cycles": [{"block": [5, 1, 2, 3, 4], "accepted": 2, "stages": 1, "lookup": False, "parents": None},
               {"block": [7, 10, 11, 12, 13, 14], "accepted": 2, "stages": 1, "lookup": False,
                "parents": [-1, 0, -1, 1, 0]},
               {"block": [90, 20, 21, 22, 23], "accepted": 2, "stages": 1, "lookup": False, "parents": [-1, -1, 1, 0]},
               {"block": [40, 41, 42], "accepted": 2, "stages": 0, "lookup": True, "parents": None},
               {"block": [43, 50, 51], "accepted": 1, "stages": 1, "lookup": False, "parents": None}],
    "timing": {"prefill_s": 0.1, "draft_s": 0.2, "verify_s": 0.6, "other_s": 0.05, "total_s": 0.95,
               "tokens_per_s": 14.7},
    "config": {"block_size": 4, "temperature": 0.0, "lookup": True, "tree": 5},
}


class Page(HTMLParser):
    """Every data-cycle element (attributes and text), detail sections, tree nodes and script/link tags."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.cycles: list[dict] = []
        self.details: dict[str, dict] = {}
        self.nodes: dict[str, dict[str, str]] = {}  # detail id → node index → li class
        self.tags: list[tuple[str, dict]] = []
        self.stack: list[tuple[str, dict | None]] = []
        self.detail: str | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        rec = None
        if "data-cycle" in a:
            rec = {"cycle": a["data-cycle"], "accepted": a["data-accepted"], "text": "", "class": a.get("class", "")}
            self.cycles.append(rec)
        if "data-detail" in a:
            self.detail = a["data-detail"]
            self.details[self.detail] = {"text": "", "hidden": "hidden" in a}
        if "data-node" in a and self.detail is not None:
            self.nodes.setdefault(self.detail, {})[a["data-node"]] = a.get("class", "")
        self.stack.append((tag, rec))

    def handle_endtag(self, tag):
        while self.stack:
            t, _ = self.stack.pop()
            if t == tag:
                break
        if tag == "section":
            self.detail = None

    def handle_data(self, data):
        for _, rec in self.stack:
            if rec is not None:
                rec["text"] += data
        if self.detail is not None:
            self.details[self.detail]["text"] += data


@lru_cache(maxsize=None)
def tiny_record() -> str:
    """A real record from a tiny target: oracle drafts (every accept length) and prompt-lookup cycles."""
    model = tiny_target()
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    ref = hf_greedy(model, prompt, 48)
    propose = oracle_proposer(ref, 0.25, 3, model.config.vocab_size)
    result = generate_drafted(model, None, prompt, block_size=5, max_new_tokens=48, propose=propose, lookup=True)
    return json.dumps(result.to_record())


def record() -> dict:
    return json.loads(tiny_record())


def span_text(ids: list[int]) -> str:
    return "".join(words(t) for t in ids)


# ---------------------------------------------------------------- structure (no browser)

def test_every_cycle_is_one_element_matching_the_record():
    rec = record()
    page = Page(render(rec, words))
    assert [(int(c["cycle"]), int(c["accepted"])) for c in page.cycles] == \
        [(i, c["accepted"]) for i, c in enumerate(rec["cycles"])]
    assert len(rec["cycles"]) > 5 and {c["accepted"] for c in rec["cycles"]} >= {0, 1}
    pos = 1
    for c, el in zip(rec["cycles"], page.cycles):  # each span holds exactly the tokens its cycle emitted
        n = min(c["accepted"] + 1, len(rec["output_ids"]) - pos)
        assert el["text"] == span_text(rec["output_ids"][pos: pos + n])
        pos += n
    assert pos == len(rec["output_ids"])
    assert set(page.details) == {"none"} | {str(i) for i in range(len(rec["cycles"]))}
    assert all(d["hidden"] for k, d in page.details.items() if k != "none")


def test_lookup_and_chain_cycles_are_labelled():
    rec = record()
    assert any(c["lookup"] for c in rec["cycles"]) and not all(c["lookup"] for c in rec["cycles"])
    page = Page(render(rec, words))
    for c, el in zip(rec["cycles"], page.cycles):
        want = "none" if not c["accepted"] else "lookup" if c["lookup"] else "chain"
        assert f"s-{want}" in el["class"].split()
        text = page.details[el["cycle"]]["text"]
        assert ("drafted by prompt lookup" in text) == c["lookup"]


def test_hand_record_chain_rejection_and_target_token():
    page = Page(render(HAND, words))
    d = page.details["0"]["text"]
    assert "kept 2 of 4 drafts" in d and "drafter chain" in d
    assert re.search(r"rejected\s*t3␣\s*target\s*t7␣", d)  # chips show spaces as ␣
    assert re.search(r"rejected\s*t13␣\s*target\s*t90␣", page.details["1"]["text"])
    assert "bonus" in page.details["3"]["text"]  # the lookup cycle kept both drafts
    assert "ended inside this cycle" in page.details["4"]["text"]
    assert [c["accepted"] for c in page.cycles] == ["2", "2", "2", "2", "1"]


def test_tree_is_drawn_with_the_kept_path_highlighted():
    page = Page(render(HAND, words))
    assert page.nodes["1"] == {"0": "n-on", "1": "n-on", "2": "n-off", "3": "n-rej", "4": "n-off"}
    assert "tree, main branch" in page.details["1"]["text"]
    assert page.nodes["2"] == {"0": "n-off", "1": "n-on", "2": "n-on", "3": "n-off"}
    assert "tree, side branch" in page.details["2"]["text"]
    cycles = build_cycles(HAND)
    assert cycles[1].path == (0, 1) and cycles[2].path == (1, 2)
    assert [c.source for c in cycles] == ["chain", "main", "side", "lookup", "chain"]


def test_grafted_lookup_path_is_marked():
    rec = json.loads(json.dumps(HAND))
    rec["config"]["tree"] = 3  # nodes 3 and 4 were appended by the lookup graft: its path is 0 → 4
    rec["cycles"][1]["lookup"] = True
    rec["output_ids"][5] = 14  # the cycle kept nodes 0 and 4
    cycles = build_cycles(rec)
    assert cycles[1].lookup_nodes == {0, 4} and cycles[1].source == "lookup-path"
    page = render(rec, words)
    assert 'title="from prompt lookup">L</span>' in page and "tree, lookup path" in page


def test_text_is_escaped_and_special_characters_visible():
    evil = {1: "<script>alert(1)</script>", 2: "a&b\"c'", 7: "\n", 10: "\tx", 11: "\x07", 21: " lead"}
    page = render(HAND, lambda t: evil.get(t, f"w{t}"))
    assert page.count("<script") == 1 and "alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a&amp;b&quot;c&#x27;" in page
    assert '<span class="ws">↵</span>\n' in page and '<span class="ws">→</span>\tx' in page
    assert '<span class="ws">␇</span>' in page and '<span class="ws">␣</span>lead' in page
    parsed = Page(page)
    assert parsed.cycles[0]["text"].startswith("<script>alert(1)</script>")


def test_page_is_self_contained():
    page = render(record(), words)
    tags = Page(page).tags
    assert not [a for t, a in tags if t in ("link", "img", "iframe") or "src" in a or "href" in a]
    assert "http://" not in page and "https://" not in page and "@import" not in page
    assert sum(t == "svg" for t, _ in tags) == 3 and sum(t == "script" for t, _ in tags) == 1


def test_odd_settings_and_timing_do_not_break_the_page():
    rec = json.loads(json.dumps(HAND)) | {"config": "x", "timing": {"total_s": "slow", "tokens_per_s": None},
                                         "num_prompt_tokens": "<9>"}
    rec["cycles"][0]["stages"] = "two"
    page = render(rec, words)
    assert "No timing in this record" in page and "&lt;9&gt; prompt tokens" in page


def test_per_cycle_times_are_plotted_when_present():
    rec = json.loads(json.dumps(HAND))
    assert "timing is total only" in render(rec, words)
    for i, c in enumerate(rec["cycles"]):
        c["time_s"] = 0.01 * (i + 1)
    page = render(rec, words)
    assert "timing is total only" not in page and "ms per cycle" in page and "50.0 ms" in page


@pytest.mark.parametrize("change, problem", [
    (lambda r: r.pop("output_ids"), "output_ids must be a list of integers"),
    (lambda r: r["output_ids"].__delitem__(slice(-2, None)), "emit more tokens than output_ids"),
    (lambda r: r["output_ids"].pop(), "emit more tokens than output_ids"),
    (lambda r: r["output_ids"].extend([3, 3]), "emit 15 tokens"),
    (lambda r: r["cycles"][1].update(parents=[-1, 0, -1, 1]), "parents must give each draft"),
    (lambda r: r["cycles"][0].update(accepted=9), "keeps 9 drafts but drafted 4"),
    (lambda r: r["cycles"][1].update(parents=[-1, -1, -1, -1, -1]), "not a root path of its draft tree"),
    (lambda r: r["cycles"].__setitem__(0, "x"), "cycle 0 has no 'accepted'"),
])
def test_bad_records_raise_one_line(change, problem):
    rec = json.loads(json.dumps(HAND))
    change(rec)
    with pytest.raises(FlashdraftError) as e:
        render(rec, words)
    assert problem in str(e.value) and "\n" not in str(e.value) and "flashdraft generate --json" in str(e.value)


def bench_record(sample_id: str, method: str, lengths: list[int], stages: list[int], lookups: int) -> dict:
    ids = list(range(10, 11 + sum(lengths)))
    turn = {"prompt_len": 12, "output_ids": ids, "text": "", "new_tokens": len(ids), "first_tokens": 1,
            "ttft_s": 0.1, "total_s": 1.0, "decode_s": 0.9, "acceptance_lengths": lengths, "stages": stages,
            "lookup_cycles": lookups, "cycle_timing": True, "draft_s": 0.2, "verify_s": 0.6, "other_s": 0.1}
    return {"dataset": "gsm8k", "id": sample_id, "method": method, "turns": [turn]}


def test_bench_record_without_cycles():
    rec = bench_turn(bench_record("a", "dflash2", [3, 1, 5, 2], [1, 0, 0, 1], 2))
    page = Page(render(rec, words))
    assert [(c["cycle"], c["accepted"]) for c in page.cycles] == [("0", "2"), ("1", "0"), ("2", "4"), ("3", "1")]
    assert "drafts were not recorded" in page.details["0"]["text"]
    assert "s-lookup" in page.cycles[2]["class"] and "s-drafter" in page.cycles[0]["class"]
    assert Page(render(bench_record("a", "dflash2", [3, 1], [1, 1], 0), words)).cycles[1]["accepted"] == "0"
    with pytest.raises(FlashdraftError, match="has 1 turn"):
        bench_turn(bench_record("a", "dflash2", [2], [1], 0), turn=2)


def test_lowest_tau_picks_drafting_samples():
    recs = [bench_record("a", "dflash2", [3, 3], [1, 1], 0), bench_record("b", "ar", [1, 1], [], 0),
            bench_record("c", "dflash2", [1, 2], [1, 1], 0), bench_record("d", "hf", [2], [], 0),
            bench_record("e", "llamacpp-dflash2[f32]", [2, 2], [], 0), bench_record("f", "llamacpp[f32]", [], [], 0)]
    assert [r["id"] for r in lowest_tau(recs, 2)] == ["c", "e"]
    assert [r["id"] for r in lowest_tau(recs, 10)] == ["c", "e", "a"]
    assert lowest_tau(recs, 0) == []


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="flashdraft")
    add_trace(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cmd_trace_generate_record_and_bench_jsonl(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "rec.json").write_text(json.dumps(HAND, indent=1))
    assert run_cli("trace", str(tmp_path / "rec.json"), "-o", str(tmp_path / "a.html"), "--target",
                   str(tmp_path / "tok")) == 0
    assert "t10" in (tmp_path / "a.html").read_text()  # rendered by the tokenizer (word-level: t0..t95)
    samples = tmp_path / "run" / "samples.jsonl"
    samples.parent.mkdir()
    samples.write_text("".join(json.dumps(bench_record(i, m, [2, 3], [1, 1], 0)) + "\n"
                               for i in ("x", "y") for m in ("ar", "dflash2")))
    (samples.parent / "run.json").write_text(json.dumps({"config": {"target": str(tmp_path / "tok")}}))
    assert run_cli("trace", str(samples), "-o", str(tmp_path / "b.html"), "--id", "y", "--method", "dflash2") == 0
    assert [c["accepted"] for c in Page((tmp_path / "b.html").read_text()).cycles] == ["1", "2"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(FlashdraftError, match="2 samples match"):
        run_cli("trace", str(samples), "-o", str(tmp_path / "c.html"), "--method", "dflash2")
    with pytest.raises(FlashdraftError, match="no sample matches --id z"):
        run_cli("trace", str(samples), "-o", str(tmp_path / "c.html"), "--id", "z")
    with pytest.raises(FlashdraftError, match="not found"):
        run_cli("trace", str(tmp_path / "missing.json"), "-o", str(tmp_path / "c.html"))


def test_ids_shown_without_a_tokenizer(tmp_path):
    path = trace_for_generate(HAND, object(), tmp_path / "g.html")
    assert "[10]" in path.read_text()
    recs = [bench_record("a", "dflash2", [3, 1], [1, 1], 0), bench_record("b", "dflash2", [2, 2], [1, 1], 0)]
    out = trace_bench(recs, object(), tmp_path / "traces", 1)
    assert [p.name for p in out] == ["gsm8k-a-dflash2.html"] and out[0].is_file()


# ---------------------------------------------------------------- in a headless browser

BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    """$FLASHDRAFT_CHROMIUM, else a Chromium or Chrome on PATH."""
    names = [os.environ.get("FLASHDRAFT_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"]
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    required = os.environ.get("FLASHDRAFT_REQUIRE_BROWSER") == "1"  # CI installs one: a skip there would hide a gap
    if exe is None:
        if required:
            pytest.fail("FLASHDRAFT_REQUIRE_BROWSER=1 but no Chromium on PATH")
        pytest.skip("no Chromium on PATH (apt-get install chromium, or set FLASHDRAFT_CHROMIUM)")
    if required:
        import playwright.sync_api as sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests drive Chromium with playwright")
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, args=BROWSER_ARGS, headless=True,
                                                   viewport={"width": 1280, "height": 900})
        yield ctx
        ctx.close()


@pytest.fixture()
def page(browser, tmp_path):
    """The tiny record's page, loaded from a file; console errors and page errors collected in page.errors."""
    path = write_trace(record(), tmp_path / "trace.html", words)
    pg = browser.new_page()
    pg.errors = []
    pg.on("console", lambda m: pg.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: pg.errors.append(f"page error: {e}"))
    pg.goto(path.as_uri())
    yield pg
    pg.close()


@pytest.mark.browser
def test_browser_opens_clean_and_cycles_match(page):
    got = page.eval_on_selector_all("[data-cycle]", "els => els.map(e => [+e.dataset.cycle, +e.dataset.accepted])")
    assert got == [[i, c["accepted"]] for i, c in enumerate(record()["cycles"])]
    assert page.is_visible('[data-detail="none"]') and not page.is_visible('[data-detail="0"]')
    assert page.errors == []


@pytest.mark.browser
def test_browser_hover_and_click_show_details(page):
    page.hover('[data-cycle="2"]')
    assert page.is_visible('[data-detail="2"]') and not page.is_visible('[data-detail="none"]')
    assert "Cycle 2" in page.inner_text('[data-detail="2"]')
    page.click('[data-ref="4"]')  # a bar of the per-cycle plot pins its cycle
    page.mouse.move(1, 1)
    assert page.is_visible('[data-detail="4"]') and not page.is_visible('[data-detail="2"]')
    assert "sel" in page.get_attribute('[data-cycle="4"]', "class")
    page.keyboard.press("ArrowRight")
    assert page.is_visible('[data-detail="5"]') and not page.is_visible('[data-detail="4"]')
    assert page.errors == []


@pytest.mark.browser
def test_browser_tree_and_screenshot_not_blank(browser, tmp_path):
    import matplotlib.image

    path = write_trace(HAND, tmp_path / "hand.html", words)
    pg = browser.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(path.as_uri())
    pg.click('[data-cycle="1"]')
    assert pg.eval_on_selector_all('[data-detail="1"] li.n-on', "els => els.length") == 3  # anchor + 2 kept nodes
    assert pg.is_visible('[data-detail="1"] li.n-rej')
    pg.screenshot(path=str(tmp_path / "shot.png"), full_page=True)
    img = matplotlib.image.imread(str(tmp_path / "shot.png"))[..., :3]
    assert img.shape[0] > 300 and img.shape[1] > 600
    assert img.std() > 0.05 and (img.mean(-1) < 0.9).mean() > 0.02  # text and plots, not a blank page
    assert errors == []
    pg.close()


@pytest.mark.slow
def test_default_target_trace_renders_its_own_tokens(tmp_path):
    """A real generate record of the default target and its drafter, rendered with the target's tokenizer."""
    from flashdraft.decoding import generate_ids
    from flashdraft.models import load_drafter_for, load_target

    target = load_target()
    drafter = load_drafter_for(target, None)
    ids = target.encode("Janet has 3 apples and buys 4 more. How many apples does she have?")
    result = generate_ids(target.model, drafter, ids, block_size=4, max_new_tokens=32,
                          stop_token_ids=target.stop_token_ids())
    result.text = target.decode(result.output_ids)
    rec = result.to_record()
    parsed = Page(trace_for_generate(rec, target, tmp_path / "t.html").read_text())
    assert [int(c["accepted"]) for c in parsed.cycles] == [c["accepted"] for c in rec["cycles"]]
    spans = target.decode(rec["output_ids"][:1]) + "".join(c["text"] for c in parsed.cycles)
    assert spans.replace("↵", "").startswith(result.text[:20])


def test_generate_and_bench_write_trace_pages(tmp_path, capsys):
    """`generate --trace FILE.html` and `bench --trace N`: pages whose cycles match the records, drafts included."""
    from helpers import random_drafter, save_tiny_model_dir

    from flashdraft.checkpoint import save_drafter
    from flashdraft.cli import main

    target = save_tiny_model_dir(tmp_path / "t")
    save_drafter(random_drafter(target, block_size=4), tmp_path / "d")
    common = ["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d")]
    assert main(["generate", *common, "--prompt-ids", "5,6,7,5,6,7,5", "--max-new-tokens", "20", "--json",
                 "--trace", str(tmp_path / "g.html")]) == 0
    rec = json.loads(capsys.readouterr().out)
    page = Page((tmp_path / "g.html").read_text())
    assert [int(c["accepted"]) for c in page.cycles] == [c["accepted"] for c in rec["cycles"]]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"t{i} t{i + 1} t{i} t{i + 1}"]}) + "\n"
                            for i in range(3)))
    assert main(["bench", *common, "--dataset", str(data), "--methods", "dflash", "--max-new-tokens", "12",
                 "--out", str(tmp_path / "run"), "--trace", "2"]) == 0
    pages = sorted((tmp_path / "run" / "traces").glob("*.html"))
    assert len(pages) == 2
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    drafted = {s["id"]: s["turns"][0] for s in samples if s["method"] != "ar"}
    for p in pages:
        turn = next(t for i, t in drafted.items() if f"-{i}-" in p.name)
        assert [int(c["accepted"]) for c in Page(p.read_text()).cycles] == [c["accepted"] for c in turn["cycles"]]
    assert main(["bench", *common, "--dataset", str(data), "--out", str(tmp_path / "x"), "--trace", "-1"]) == 2
