"""Issue 43: one request never hurts another, and nobody else gets in. The app runs in this process (Starlette's
TestClient, a tiny model built in code): bad numbers never reach the decoder, a row that raises fails alone, memory
stays bounded, the API key / Host header / content type / body timeout guard the routes, and a schemathesis run over
the OpenAPI schema finds no 5xx."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import random_drafter, tiny_target
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import char_tokenizer

from flashdraft.decoding import DecodeSettings, generate_ids
from flashdraft.decoding.decoder import Decoder, decode_batch
from flashdraft.errors import FlashdraftError
from flashdraft.models import Target
from flashdraft.cli.serve import api_key, check_options
from flashdraft.serve.app import allowed_hosts, create_app, read_body
from flashdraft.serve.worker import RATE_WINDOW_S, Worker, GenRequest, Stats, TextTracker
from flashdraft.serve.protocol import MAX_STOP_CHARS, Served
from flashdraft.serve.scheduler import Limits, Scheduler

MODEL = "tiny-target"
URL = "http://127.0.0.1:8000"
CONTEXT = 256


@pytest.fixture(scope="module")
def tiny():
    model = tiny_target("llama", seed=3, max_pos=CONTEXT)
    return Target(model, char_tokenizer(), MODEL), random_drafter(model, block_size=4)


def make_app(tiny, api_key: str | None = None, hosts: list[str] | None = None, max_batch: int = 4,
             limits: Limits | None = None):
    target, drafter = tiny
    worker = Worker(target, drafter, DecodeSettings(), max_batch)
    scheduler = Scheduler(worker, limits or Limits(request_timeout=60))
    app = create_app(scheduler, Served([MODEL], target, 16, worker.tokens), api_key, hosts)
    return app, scheduler


@pytest.fixture(scope="module")
def served(tiny):
    app, scheduler = make_app(tiny)
    with TestClient(app, base_url=URL) as client:
        yield client, scheduler


def completion(client: TestClient, **body) -> tuple[int, dict]:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc def", "max_tokens": 8, **body})
    return r.status_code, r.json()


# ---------------------------------------------------------------- 1. numbers that cannot be decoded

BAD_NUMBERS = [  # raw JSON: 1e309 parses as infinity, and Python's json reads NaN / Infinity
    ("temperature", "1e309"), ("temperature", "NaN"), ("temperature", "-Infinity"), ("temperature", "1000"),
    ("top_p", "1e309"), ("top_p", "NaN"), ("top_k", "1e309"), ("top_k", str(2 ** 40)), ("max_tokens", "1e309"),
    ("max_tokens", "NaN"), ("seed", "1e309"), ("seed", str(2 ** 64)), ("presence_penalty", "1e309"),
    ("frequency_penalty", "NaN"), ("max_completion_tokens", "Infinity"),
]


@pytest.mark.parametrize("field,raw", BAD_NUMBERS, ids=[f"{f}={v}" for f, v in BAD_NUMBERS])
def test_non_finite_or_out_of_range_numbers_get_400_naming_the_field(served, monkeypatch, field, raw):
    client, scheduler = served
    submitted = []
    monkeypatch.setattr(scheduler.worker, "submit", submitted.append)  # the decoder's door
    for path, body in [("/v1/completions", f'{{"prompt": "abc", "{field}": {raw}}}'),
                       ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi"}}], '
                                                f'"{field}": {raw}}}')]:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and err["message"].startswith(field), err
    assert submitted == []


@pytest.mark.parametrize("prompt", ["\u0088", ["\n\t"]])
def test_a_prompt_that_tokenizes_to_nothing_gets_400(served, monkeypatch, prompt):
    """Text the tokenizer drops entirely (schemathesis found "\u0088") is a client error, not a failed decode."""
    client, scheduler = served
    submitted = []
    monkeypatch.setattr(scheduler.worker, "submit", submitted.append)
    status, body = completion(client, prompt=prompt)
    assert status == 400 and body["error"]["param"] == "prompt" and "empty" in body["error"]["message"], body
    assert submitted == []


def test_the_repro_infinite_temperature_beside_a_normal_request(served):
    """Issue 43's repro: "temperature": 1e309 next to a normal request. The first gets a 400, the second its answer."""
    client, _ = served
    out: dict = {}
    normal = threading.Thread(target=lambda: out.update(ok=completion(client, max_tokens=40, temperature=0.7, seed=3)))
    normal.start()
    bad = client.post("/v1/completions", content='{"prompt": "x", "temperature": 1e309, "max_tokens": 40}',
                      headers={"Content-Type": "application/json"})
    normal.join(60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    status, body = out["ok"]
    assert status == 200 and body["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("kw", [dict(temperature=math.inf), dict(temperature=math.nan), dict(top_p=math.inf),
                                dict(top_p=math.nan), dict(temperature=-math.inf)])
def test_decode_settings_refuse_non_finite_sampling(kw):
    with pytest.raises(FlashdraftError) as e:
        DecodeSettings(**kw).validate()
    name = next(iter(kw))
    assert str(e.value).startswith(name) and "\n" not in str(e.value)


# ---------------------------------------------------------------- 2. a row that raises fails alone

POISON_SEED = 666


def poisoned_commit(monkeypatch, after: int = 2):
    """Decoder.commit raises (as torch.multinomial does on NaN probabilities) for rows seeded POISON_SEED once
    they have `after` cycles."""
    real = Decoder.commit

    def commit(self, row, q, p, out, block):
        if q.settings.seed == POISON_SEED and len(q.cycles) >= after:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(self, row, q, p, out, block)

    monkeypatch.setattr(Decoder, "commit", commit)


def test_a_failing_row_gets_a_generic_500_and_the_others_decode_on(served, monkeypatch, caplog):
    client, scheduler = served
    good = dict(prompt="the good one", max_tokens=120, temperature=0.8, seed=5)
    status, solo = completion(client, **good)
    assert status == 200
    poisoned_commit(monkeypatch)
    out: dict = {}
    started = threading.Event()

    def run_good():
        with client.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **good}) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()
            out["chunks"] = chunks

    t = threading.Thread(target=run_good)
    t.start()
    assert started.wait(60)
    with caplog.at_level(logging.ERROR, logger="flashdraft.serve"):
        status, bad = completion(client, prompt="the bad one", max_tokens=60, temperature=0.8, seed=POISON_SEED)
    t.join(60)
    err = bad["error"]
    assert status == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
    assert "probability" not in err["message"] and "RuntimeError" not in err["message"]
    rid = err["message"].split("request id ")[1].split(")")[0]
    assert rid.startswith("cmpl-")
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and logged[0].exc_info is not None and "probability tensor" in str(logged[0].exc_info[1])
    final = [c for c in out["chunks"] if c.get("choices") and c["choices"][0]["finish_reason"]][-1]
    assert final["flashdraft"]["output_ids"] == solo["flashdraft"]["output_ids"]
    assert final["flashdraft"]["batch"] >= 2  # the bad request decoded beside it before it failed
    assert "".join(c["choices"][0]["text"] for c in out["chunks"] if c.get("choices")) == solo["choices"][0]["text"]
    assert scheduler.metrics.requests["error"] >= 1 and completion(client)[0] == 200


def test_batch_decoder_drops_a_failing_row_and_the_others_equal_generate(tiny, monkeypatch):
    """In the decoder itself, for a fault in a row's acceptance (commit) and in its draft choice (propose)."""
    import flashdraft.decoding.decoder as batch_mod

    _, drafter = tiny
    model = tiny[0].model
    prompts = [[5, 9, 11, 40, 3], [7, 8, 9], [20, 21, 22, 23, 24, 25]]
    kw = [dict(temperature=0.0), dict(temperature=0.9, seed=4), dict(temperature=0.9, seed=POISON_SEED)]
    solo = [generate_ids(model, drafter, p, max_new_tokens=30, stop_token_ids=(), **k) for p, k in zip(prompts, kw)]
    real_chain, calls = batch_mod.chain_from_pass, {}

    def chain(d, h, lg, anchor, sampling, gen):
        calls[gen] = calls.get(gen, 0) + 1  # the drafter's generator is seeded seed + 1
        if gen.initial_seed() == POISON_SEED + 1 and calls[gen] >= 3:
            raise RuntimeError("NaN in the drafter's probabilities")
        return real_chain(d, h, lg, anchor, sampling, gen)

    for where in ("commit", "propose"):
        if where == "commit":
            poisoned_commit(monkeypatch, after=3)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(batch_mod, "chain_from_pass", chain)
        dec = Decoder(model, drafter, DecodeSettings(max_new_tokens=30, stop_token_ids=()))
        seqs = [dec.join(p, DecodeSettings(max_new_tokens=30, stop_token_ids=(), **k))[0] for p, k in zip(prompts, kw)]
        poisoned = seqs[2]
        failed = []
        while dec.active:
            failed += [q for q, _ in dec.step() if q.error is not None]
        assert failed == [poisoned] and isinstance(poisoned.error, RuntimeError), where
        for q, ref in zip(seqs[:2], solo[:2]):
            assert q.output == ref.output_ids, where
        assert dec.cache.rows == 0
        with pytest.raises(RuntimeError):  # the Python API asked for every prompt: a failure fails the call
            decode_batch(model, drafter, prompts, [DecodeSettings(max_new_tokens=30, stop_token_ids=(), **k)
                                                     for k in kw])


# ---------------------------------------------------------------- 4. bounded memory and work

def test_the_rate_window_keeps_per_second_buckets(monkeypatch):
    clock = SimpleNamespace(t=1000.0)
    monkeypatch.setattr("flashdraft.serve.worker.time.monotonic", lambda: clock.t)
    stats = Stats()
    for _ in range(100):  # 100 s at 1,000 events of 3 tokens per second
        for _ in range(1000):
            stats.emitted(3)
            clock.t += 1e-3
    assert len(stats.recent) <= RATE_WINDOW_S + 1 and stats.tokens == 300_000
    assert stats.tokens_per_s() == pytest.approx(3000, rel=0.02)
    clock.t += 3600
    assert stats.tokens_per_s() == 0


def test_metrics_are_prometheus_text(served):
    client, _ = served
    assert completion(client)[0] == 200
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["flashdraft_requests"].type == "counter"
    ok = [s for s in families["flashdraft_requests"].samples if s.labels == {"outcome": "ok"}]
    assert ok[0].name == "flashdraft_requests_total" and ok[0].value >= 1
    hist = families["flashdraft_step_batch_size"]
    assert hist.type == "histogram" and {s.labels.get("le") for s in hist.samples} >= {"1", "8", "+Inf"}
    for name in ("flashdraft_mean_tau", "flashdraft_tokens_per_second", "flashdraft_batch_size",
                 "flashdraft_queued_requests", "flashdraft_max_batch", "flashdraft_generated_tokens"):
        assert name in families, name


def test_stop_strings_are_bounded(served):
    client, _ = served
    status, body = completion(client, stop=["x" * (MAX_STOP_CHARS + 1)])
    assert status == 400 and body["error"]["param"] == "stop" and str(MAX_STOP_CHARS) in body["error"]["message"]
    assert completion(client, stop=["y" * MAX_STOP_CHARS])[0] == 200


def test_text_tracker_releases_a_long_run_of_spaces_as_it_settles():
    """A trailing space waits only while a later token may still rewrite it (inside the window): an output of
    thousands of spaces streams out instead of being held (and rescanned every cycle) until the end."""
    t = TextTracker(lambda ids: "".join(" " if i == 0 else "ab"[i - 1] for i in ids), ["ab"])
    sent = "".join(t.add([0]) for _ in range(5000))
    assert len(sent) >= 5000 - 100 and set(sent) == {" "}
    rest = t.add([1])  # the spaces still in the window go; "a" may begin the stop string
    assert sent + rest == " " * 5000 and t.add([2]) == "" and t.stopped and t.finish() == ""
    assert t.text == " " * 5000


def test_text_tracker_work_does_not_grow_with_the_output():
    """The text kept in view per cycle (the settled head and the window) stays bounded over a long output."""
    t = TextTracker(lambda ids: "".join(chr(97 + i % 26) for i in ids), ["zzq", "never"])
    seen = 0
    for i in range(20000):
        t.add([i])
        seen = max(seen, len(t.head) + len(t.tail))
    assert seen < 200 and len(t.text) == 20000 and t.finish() == ""


class StubEngine:
    max_batch = 1

    def __init__(self):
        self.stats, self.inbox = Stats(), []

    def submit(self, job) -> None:
        self.inbox.append(job)


def test_the_admission_bound_counts_only_live_jobs():
    async def run():
        sch = Scheduler(StubEngine(), Limits(max_queue=1))
        sch._loop = asyncio.get_running_loop()
        gen = GenRequest([1, 2], 4)
        a, b = sch.submit(gen, False), sch.submit(gen, False)
        with pytest.raises(Exception) as e:
            sch.submit(gen, False)
        assert e.value.status == 429
        a.abort("client")  # its handler has not finished it yet: the worker drops it at the next boundary
        b.state = "ended"  # the worker ended it (done, failed or timed out), its handler has not read it yet
        sch.submit(gen, False), sch.submit(gen, False)  # two more fit: a and b no longer count
        assert sch.queued == 2 and sch.live == 2 and len(sch.admitted) == 4

    asyncio.run(run())


def test_served_requests_leave_nothing_behind(served):
    """Hundreds of requests (streamed and not, greedy and sampled): no job, decoding request, result or tracker
    outlives its request, and the Python heap stops growing (the soak's RSS is the native side: docs/bench/soak)."""
    import collections
    import gc
    import tracemalloc

    client, _ = served

    def run(n: int) -> None:
        for i in range(n):
            body = {"model": MODEL, "prompt": f"abc def {i}", "max_tokens": 24, "temperature": 0.7 * (i % 2),
                    "seed": i}
            if i % 3 == 0:
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 1
            else:
                assert client.post("/v1/completions", json=body).status_code == 200

    def alive() -> dict[str, int]:
        gc.collect()
        kinds = collections.Counter(type(o).__name__ for o in gc.get_objects())
        return {k: kinds[k] for k in ("Job", "Request", "GenerationResult", "TextTracker")}

    run(20)
    tracemalloc.start()
    try:
        run(60)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run(60)
        gc.collect()
        grew = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(n <= 1 for n in alive().values()), alive()  # at most the worker's last request, until the next
    assert grew < 64 * 1024, f"the Python heap grew by {grew} bytes over 60 requests"


def test_served_requests_are_freed_without_the_cycle_collector(served):
    """A finished request's state (its Request, caches and tensors) goes when its handler does, by reference counts
    alone: a busy server runs a full garbage collection only now and then, and whatever waits for one holds native
    memory meanwhile (the soak's RSS climbed ~0.3 MB a request while a job and its Request referred to each other)."""
    import gc

    client, _ = served
    body = {"model": MODEL, "prompt": "abc def", "max_tokens": 16, "temperature": 0}
    gc.collect()
    gc.disable()
    try:
        for i in range(6):
            if i % 2:
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 1
            else:
                assert client.post("/v1/completions", json={**body, "seed": i}).status_code == 200
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        owed = [o for o in gc.garbage if isinstance(o, torch.Tensor) or type(o).__module__.startswith("flashdraft")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not owed, sorted({type(o).__name__ for o in owed})


# ---------------------------------------------------------------- 5. who may talk to the server

def test_api_key_is_required_except_on_health(tiny):
    app, _ = make_app(tiny, api_key="s3cret")
    with TestClient(app, base_url=URL) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")]:
                r = client.request(method, path, json={"prompt": "x", "max_tokens": 2}, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, path)
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ok)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert client.get("/v1/models", headers=ok).status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    args = SimpleNamespace(api_key=None)
    monkeypatch.delenv("FLASHDRAFT_API_KEY", raising=False)
    assert api_key(args) is None
    monkeypatch.setenv("FLASHDRAFT_API_KEY", "from-env")
    assert api_key(args) == "from-env" and api_key(SimpleNamespace(api_key="flag")) == "flag"


def test_allowed_hosts_follow_the_bind():
    assert allowed_hosts("127.0.0.1", []) == ["localhost", "127.0.0.1", "[::1]"]
    assert allowed_hosts("::1", ["box.lan"]) == ["localhost", "127.0.0.1", "[::1]", "box.lan"]
    assert allowed_hosts("0.0.0.0", []) == ["*"] and allowed_hosts("::", []) == ["*"]
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == ["box.lan"]
    assert "10.0.0.5" in allowed_hosts("10.0.0.5", []) and "[fe80::1]" in allowed_hosts("fe80::1", [])


def test_host_header_is_checked_so_dns_rebinding_cannot_reach_a_loopback_server(tiny):
    app, _ = make_app(tiny, hosts=allowed_hosts("127.0.0.1", ["box.lan"]))
    with TestClient(app, base_url=URL) as client:
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "localhost", "box.lan:8000"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example:8000", "attacker.com", "127.0.0.1.nip.io:8000"):
            r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Host": host})
            assert r.status_code == 400, host


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_post_that_is_not_json_gets_415(served, content_type):
    client, _ = served
    headers = {"Content-Type": content_type} if content_type else {}
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}]}',
                    headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_a_body_that_trickles_gets_408():
    from starlette.requests import Request

    async def run():
        async def receive():
            await asyncio.sleep(0.2)
            return {"type": "http.request", "body": b"{", "more_body": True}

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            await read_body(request, 1 << 20, 0.5)
        assert e.value.status == 408 and e.value.code == "body_timeout" and time.monotonic() - t0 < 5

    asyncio.run(run())


@pytest.mark.parametrize("flag,value,match", [
    ("max_connections", 0, "--max-connections must be > 0"), ("body_timeout", 0, "--body-timeout must be > 0"),
    ("api_key", " ", "--api-key is empty"), ("allowed_hosts", "a*b.com", "--allowed-hosts"),
    ("threads", 0, "--threads must be >= 1"), ("prefix_cache_mib", -1, "--prefix-cache-mib must be >= 0"),
])
def test_access_flags_are_checked(flag, value, match):
    args = SimpleNamespace(engine="torch", vllm_args=None, print_command=False, port=0, max_queue=1, max_batch=1,
                           prefill_chunk=256, request_timeout=1, shutdown_timeout=1, max_body_bytes=1,
                           default_max_tokens=1, max_connections=1, body_timeout=1, block_size=None, api_key=None, allowed_hosts=None,
                           threads=None, prefix_cache_mib=0)
    setattr(args, flag, value)
    with pytest.raises(FlashdraftError, match=match):
        check_options(args)


# ---------------------------------------------------------------- 6. fuzzing the OpenAPI schema

def test_openapi_schema_describes_the_request_bodies(served):
    client, _ = served
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "temperature", "max_tokens", "stop"} <= set(chat["properties"])
    assert "messages" in chat["required"]
    temperature = [s for s in chat["properties"]["temperature"]["anyOf"] if s.get("type") == "number"][0]
    assert temperature["minimum"] == 0 and temperature["maximum"] == 100
    assert "/v1/completions" in schema["paths"]


def test_schemathesis_finds_no_server_error(tiny):
    """Requests generated from the OpenAPI schema (bodies from the pydantic models), streaming or not: no 5xx, some
    reach the decoder, and a normal request is answered correctly afterwards."""
    import schemathesis  # the dev extra
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation.modes import GenerationMode
    from schemathesis.python import asgi

    app, _ = make_app(tiny)
    statuses: dict[str, list[int]] = {}
    try:  # schemathesis runs the app's lifespan (the decode worker) in its own event loop thread
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        for result in schema.get_all_operations():
            operation = result.ok()
            seen = statuses.setdefault(f"{operation.method.upper()} {operation.path}", [])

            cases = st.one_of(*(operation.as_strategy(mode) for mode in GenerationMode))  # valid and invalid

            @settings(max_examples=80 if operation.method.upper() == "POST" else 5, deadline=None, database=None,
                      derandomize=True,  # the same requests every run: "some reach the decoder" cannot flake
                      suppress_health_check=list(HealthCheck))
            @given(case=cases)
            def fuzz(case):
                response = case.call()
                seen.append(response.status_code)
                case.validate_response(response, checks=[not_a_server_error])

            fuzz()
        with asgi.get_client(app) as client:
            r = client.post(f"http://{asgi.HOST}/v1/completions", json={
                "model": MODEL, "prompt": [5, 9, 11, 40, 3], "max_tokens": 25, "temperature": 0})
            body = r.json()
    finally:
        asgi.shutdown_lifespans()
    print("\nschemathesis statuses:", {k: sorted(set(v)) for k, v in statuses.items()})
    for op in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert 200 in statuses[op], statuses  # the fuzzing reached the decoder
    want = generate_ids(tiny[0].model, tiny[1], [5, 9, 11, 40, 3], max_new_tokens=25, stop_token_ids=())
    assert r.status_code == 200 and body["flashdraft"]["output_ids"] == want.output_ids


# ---------------------------------------------------------------- the flags, end to end

def test_access_flags_reach_the_running_server(tmp_path, monkeypatch):
    """`flashdraft serve` as a process: the API key from FLASHDRAFT_API_KEY, --allowed-hosts, --body-timeout and
    --max-connections (uvicorn's limit_concurrency) are in force."""
    import http.client
    import socket

    from serve_helpers import Server, make_model_dirs

    target, drafter = make_model_dirs(tmp_path, max_pos=512)
    monkeypatch.setenv("FLASHDRAFT_API_KEY", "k3y")
    server = Server("--target", str(target), "--drafter", str(drafter), "--allowed-hosts", "box.lan",
                    "--body-timeout", "1", "--max-connections", "3")
    try:
        body = {"model": "tiny-target", "prompt": "x", "max_tokens": 2}
        assert server.request("POST", "/v1/completions", body)[0] == 401
        auth = {"Authorization": "Bearer k3y"}
        status, resp, _ = server.request("POST", "/v1/completions", body, auth)
        assert status == 200 and resp["usage"]["completion_tokens"] == 2
        assert server.request("GET", "/v1/models", headers={**auth, "Host": "box.lan:80"})[0] == 200
        assert server.request("GET", "/v1/models", headers={**auth, "Host": "rebound.example"})[0] == 400
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k3y\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        answer = ""
        while "body_timeout" not in answer:
            chunk = slow.recv(4096).decode()
            if not chunk:
                break
            answer += chunk
        assert answer.startswith("HTTP/1.1 408") and "body_timeout" in answer and time.monotonic() - t0 < 10
        slow.close()
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(3)]
        time.sleep(0.5)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503  # past --max-connections
        conn.close()
        for s in idle:
            s.close()
        time.sleep(0.5)
        assert server.request("GET", "/health")[0] == 200
    finally:
        server.terminate()


def test_the_worker_warms_up_on_a_decoder_it_then_drops(tiny, monkeypatch, caplog):
    """A process's first passes are several times slower than warm ones (the first drafter pass over two rows: 61 ms
    against 8.6): made-up requests take them on a decoder of their own, at two rows and one, speculating and not, and
    the decoder that serves starts with no measurements."""
    made, make = [], Worker.decoder
    monkeypatch.setattr(Worker, "decoder", lambda self: made.append(make(self)) or made[-1])
    worker = Worker(*tiny, DecodeSettings(), 4)
    worker.start()
    worker.stop()
    worker.thread.join(timeout=120)
    assert len(made) == 2 and "warm-up" not in caplog.text
    warm, serving = (d.policy for d in made)
    assert sorted(warm.sizes) == [1, 2]
    assert all(min(b.verify.amounts) == 1 and max(b.verify.amounts) > 1 for b in warm.sizes.values())
    assert warm.draft.seen and serving.sizes == {} and not serving.draft.seen
