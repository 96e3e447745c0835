"""`flashdraft serve` as a real process on a free loopback port, driven by the `openai` client and raw HTTP:
equality with `flashdraft generate`, streaming, every bad request, disconnects, timeouts, the queue bound, SIGTERM,
and a bounded load test."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest
from serve_helpers import Server, char_tokenizer, cli_generate, make_model_dirs
from serve_load import Case, references, run_load

import flashdraft
from flashdraft.cli import main
from flashdraft.serve.worker import HOLD_IDS, PerThread, TextTracker

MODEL = "tiny-target"
CONTEXT = 16384  # the tiny target's
LONG = 16000  # tokens: minutes on the tiny model here (and far longer than any wait below on a fast CPU)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_model_dirs(tmp_path_factory.mktemp("serve"))


def start(request, *args: str) -> Server:
    """A server for this test module, stopped (SIGTERM, then kill) by the fixture finalizer."""
    server = Server(*args)
    request.addfinalizer(lambda: server.terminate() if server.proc.poll() is None else None)
    return server


@pytest.fixture(scope="module")
def server(request, dirs):
    target, drafter = dirs
    return start(request, "--target", str(target), "--drafter", str(drafter), "--max-batch", "3", "--max-queue", "2",
                 "--request-timeout", "120")


@pytest.fixture(scope="module")
def tight(request, dirs):
    """Small limits: one request at a time, one waiting, a 5 s request timeout, 4 KiB bodies."""
    target, drafter = dirs
    return start(request, "--target", str(target), "--drafter", str(drafter), "--max-batch", "1", "--max-queue", "1",
                 "--request-timeout", "5", "--max-body-bytes", "4096")


@pytest.fixture(scope="module")
def fixed(request, dirs):
    """--fixed-block: every cycle verifies the request's block, so its cycles equal `generate`'s at any load."""
    target, drafter = dirs
    return start(request, "--target", str(target), "--drafter", str(drafter), "--fixed-block", "--max-batch", "5",
                 "--request-timeout", "8")


def client_for(server: Server, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


@pytest.fixture(scope="module")
def refs(dirs):
    """`flashdraft generate --json` records, run side by side (each pays the import and load cost once)."""
    target, drafter = dirs
    runs = {
        "chat": ["Hello there", "--max-new-tokens", "40", "--temperature", "0"],
        "text": ["abc def", "--no-chat", "--max-new-tokens", "33", "--temperature", "0"],
        "ids": ["--prompt-ids", "5,9,11,40,3", "--max-new-tokens", "25", "--temperature", "0"],
        "sampled": ["Tell me", "--max-new-tokens", "40", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20",
                    "--seed", "7"],
    }
    out = {}
    threads = [threading.Thread(target=lambda k=k, a=a: out.__setitem__(k, cli_generate(target, drafter, *a)))
               for k, a in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert set(out) == set(runs)
    return out


def ext(resp) -> dict:
    return resp.model_extra["flashdraft"]


def wait_until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def idle(server: Server) -> bool:
    _, h, _ = server.request("GET", "/health")
    return h["queued"] == 0 and h["running"] == 0


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    """Send a request on a bare socket and leave it open (closing it is the client walking away)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def chat(content: str = "Hello there", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


# ---------------------------------------------------------------- endpoints and equality with `generate`

def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, body, _ = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    m = server.metrics()
    assert 'flashdraft_requests_total{outcome="ok"}' in m and "flashdraft_mean_tau" in m
    _, text, headers = server.request("GET", "/metrics")
    assert "# TYPE flashdraft_requests_total counter" in text and headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("fixed_block", [False, True])
def test_chat_equals_generate(server, fixed, refs, fixed_block):
    """Adaptive widths (the default) change a request's cycles, never its output; --fixed-block keeps the cycles."""
    rec = refs["chat"]
    resp = client_for(fixed if fixed_block else server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=40, temperature=0)
    assert ext(resp)["output_ids"] == rec["output_ids"]
    assert resp.choices[0].message.content == rec["text"] and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length" and resp.object == "chat.completion" and resp.model == MODEL
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == \
        (rec["num_prompt_tokens"], 40, rec["num_prompt_tokens"] + 40)
    x = ext(resp)
    lengths = x["acceptance_lengths"]
    assert x["block_size"] == 4 and x["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert sum(x["acceptance_lengths"]) == 39  # the first token comes from the prefill
    if fixed_block:
        assert x["acceptance_lengths"] == rec["acceptance_lengths"]
    assert set(x["timing"]) >= {"prefill_s", "draft_s", "verify_s", "other_s", "total_s", "queue_s"}
    assert x["timing"]["verify_s"] > 0 and x["timing"]["draft_s"] > 0


def test_completions_equal_generate(client, refs):
    resp = client.completions.create(model=MODEL, prompt="abc def", max_tokens=33, temperature=0)
    assert ext(resp)["output_ids"] == refs["text"]["output_ids"] and resp.choices[0].text == refs["text"]["text"]
    assert resp.object == "text_completion" and resp.usage.prompt_tokens == refs["text"]["num_prompt_tokens"]
    resp = client.completions.create(model=MODEL, prompt=[5, 9, 11, 40, 3], max_tokens=25, temperature=0)
    assert ext(resp)["output_ids"] == refs["ids"]["output_ids"] and resp.usage.prompt_tokens == 5


def test_tiny_temperature_is_greedy_not_a_500(client, refs):
    """1e-45 would make logits / T infinite: below MIN_TEMPERATURE a request decodes greedily."""
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=40, temperature=1e-45, seed=3)
    assert ext(resp)["output_ids"] == refs["chat"]["output_ids"]


def test_seeded_sampling_equals_generate_and_repeats(client, refs):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], max_tokens=40, temperature=0.9,
              top_p=0.9, seed=7, extra_body={"top_k": 20})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert ext(a)["output_ids"] == ext(b)["output_ids"] == refs["sampled"]["output_ids"]
    other = client.chat.completions.create(**{**kw, "seed": 8})
    assert ext(other)["output_ids"] != ext(a)["output_ids"] and ext(other)["seed"] == 8


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_streaming_equals_non_streaming(client, kind):
    if kind == "chat":
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Stream this"}], max_tokens=60, temperature=0)
        full = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        kw = dict(model=MODEL, prompt="stream this", max_tokens=60, temperature=0)
        full = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == full and len(full) > 10
    assert len(texts) > 1  # sent as blocks are accepted, not in one piece at the end
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "length"
    assert len(ext(final[0])["output_ids"]) == 60 and ext(final[0])["acceptance_lengths"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 60


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, stream):
    kw = dict(model=MODEL, prompt="stop here", max_tokens=60, temperature=0)
    full = client.completions.create(**kw)
    text = full.choices[0].text
    stop = text[20:23]
    want = text[: text.find(stop)]
    if stream:
        chunks = list(client.completions.create(**kw, stop=[stop, "never-seen"], stream=True))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert got == want and reason == ["stop"]
    else:
        resp = client.completions.create(**kw, stop=[stop, "never-seen"])
        assert resp.choices[0].text == want and resp.choices[0].finish_reason == "stop"
        ids = ext(resp)["output_ids"]
        assert ids == ext(full)["output_ids"][: len(ids)] and resp.usage.completion_tokens == len(ids) < 60


# ---------------------------------------------------------------- bad requests

BAD = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "tiny-target", "messages": [', 400, None, "invalid_json"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ("empty messages", "/v1/chat/completions", chat() | {"messages": []}, 400, "messages", None),
    ("messages missing", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("max_tokens 0", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens < 0", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ("max_tokens > context", "/v1/chat/completions", chat(max_tokens=CONTEXT + 1), 400, "max_tokens",
     "context_length_exceeded"),
    ("max_completion_tokens 0", "/v1/chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens",
     None),
    ("max_tokens a string", "/v1/chat/completions", chat(max_tokens="5"), 400, "max_tokens", None),
    ("temperature < 0", "/v1/chat/completions", chat(temperature=-0.5), 400, "temperature", None),
    ("top_p 0", "/v1/chat/completions", chat(top_p=0), 400, "top_p", None),
    ("top_p > 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("top_k < -1", "/v1/chat/completions", chat(top_k=-2), 400, "top_k", None),
    ("prompt longer than the context", "/v1/completions", {"prompt": "a" * CONTEXT}, 400, "prompt",
     "context_length_exceeded"),
    ("chat longer than the context", "/v1/chat/completions", chat("b" * CONTEXT), 400, "messages",
     "context_length_exceeded"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("prompt ids outside the vocabulary", "/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt", None),
    ("unknown role", "/v1/chat/completions", chat() | {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages", None),
    ("n > 1", "/v1/chat/completions", chat(n=2), 400, "n", "unsupported_parameter"),
    ("penalty", "/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty",
     "unsupported_parameter"),
    ("five stop strings", "/v1/completions", {"prompt": "x", "stop": list("abcde")}, 400, "stop", None),
    ("negative seed", "/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", None),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(server, name, path, body, status, param, code):
    before = server.metrics()['flashdraft_requests_total{outcome="bad_request"}']
    got, resp, _ = server.request("POST", path, body)
    assert got == status, resp
    assert set(resp) == {"error"} and set(resp["error"]) == {"message", "type", "param", "code"}
    assert resp["error"]["message"] and resp["error"]["type"] == "invalid_request_error"
    assert resp["error"]["param"] == param and resp["error"]["code"] == code
    assert server.metrics()['flashdraft_requests_total{outcome="bad_request"}'] == before + 1
    ok, resp, _ = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert ok == 200 and resp["usage"]["completion_tokens"] == 3  # and the server keeps serving


REFUSED = [("response_format", {"type": "json_object"}), ("min_p", 0.1),
           ("tool_choice", "required"), ("tools", [{"type": "function", "function": {"name": "f"}}]),
           ("logit_bias", {"5": 10}), ("logprobs", True), ("top_logprobs", 2), ("n", 2), ("n", True), ("best_of", 3),
           ("presence_penalty", 0.5), ("frequency_penalty", -0.2), ("repetition_penalty", 1.1),
           ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("min_tokens", 5), ("prompt_logprobs", 1),
           ("echo", True), ("suffix", "x"), ("stop_token_ids", [3])]
ACCEPTED = [("user", "me"), ("metadata", {"k": "v"}), ("store", False), ("parallel_tool_calls", True),
            ("stream_options", {"include_usage": True}), ("response_format", {"type": "text"}), ("logprobs", False),
            ("n", 1), ("presence_penalty", 0.0), ("repetition_penalty", 1), ("tool_choice", "none"), ("tools", []),
            ("min_p", 0), ("echo", False), ("guided_json", None), ("service_tier", "auto"), ("ignore_eos", False)]


def test_ignore_eos_decodes_exactly_max_tokens_past_the_stop_tokens(server, dirs):
    """vLLM's extension (its benchmark client sends it): no stop tokens, so exactly max_tokens, and the tokens are
    the target's own decoding with no stop ids."""
    from flashdraft.api import generate_ids
    from flashdraft.models import load_drafter_for, load_target

    target, drafter = dirs
    t = load_target(str(target))
    ref = generate_ids(t.model, load_drafter_for(t, drafter), [5, 9, 11, 40, 3], max_new_tokens=30, temperature=0,
                       stop_token_ids=())
    status, resp, _ = server.request("POST", "/v1/completions", {"prompt": [5, 9, 11, 40, 3], "max_tokens": 30,
                                                                 "temperature": 0, "ignore_eos": True})
    assert status == 200 and resp["usage"]["completion_tokens"] == 30
    assert resp["flashdraft"]["output_ids"] == ref.output_ids


FIELDS = [(f, v, True) for f, v in REFUSED] + [(f, v, False) for f, v in ACCEPTED]


@pytest.mark.parametrize("field,value,refused", FIELDS, ids=[f"{f}={json.dumps(v)}" for f, v, _ in FIELDS])
def test_fields_that_would_change_the_answer_get_400(server, field, value, refused):
    """What is not implemented and would change the answer is refused, naming the field; the rest is accepted."""
    status, resp, _ = server.request("POST", "/v1/chat/completions", chat("x", max_tokens=2) | {field: value})
    if not refused:
        assert status == 200 and resp["usage"]["completion_tokens"] == 2, resp
        return
    assert status == 400 and resp["error"]["param"] == field and resp["error"]["code"] == "unsupported_parameter"
    assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["message"].startswith(field)


def test_oversized_body_gets_413(server, tight):
    big = json.dumps(chat("x" * (1 << 20))).encode()  # just over the default 1 MiB limit
    status, resp, _ = server.request("POST", "/v1/chat/completions", big)
    assert status == 413 and resp["error"]["code"] == "body_too_large"
    chunks = iter([b'{"model": "tiny-target", "prompt": "', b"y" * 3000, b"y" * 3000, b'"}'])  # no Content-Length
    conn = http.client.HTTPConnection("127.0.0.1", tight.port, timeout=30)
    conn.request("POST", "/v1/completions", body=chunks, headers={"Content-Type": "application/json"},
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()
    assert server.request("GET", "/health")[0] == 200 and tight.request("GET", "/health")[0] == 200


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.get("/nowhere", cast_to=object)


def test_request_fields_never_load_or_touch_files(server, client, dirs, tmp_path):
    """A path as the model is only an unknown name; target / drafter / block size fields are ignored."""
    target, drafter = dirs
    for model in (str(drafter), str(target), "../tiny-target", "tiny-drafter"):
        status, resp, _ = server.request("POST", "/v1/completions", {"model": model, "prompt": "x"})
        assert status == 404 and resp["error"]["code"] == "model_not_found"
    marker = tmp_path / "written"
    body = {"model": MODEL, "prompt": "abc def", "max_tokens": 33, "temperature": 0, "drafter": str(target),
            "target": str(drafter), "block_size": 1, "output": str(marker), "out": str(marker)}
    status, resp, _ = server.request("POST", "/v1/completions", body)
    plain = client.completions.create(model=MODEL, prompt="abc def", max_tokens=33, temperature=0)
    assert status == 200 and resp["flashdraft"]["output_ids"] == ext(plain)["output_ids"]
    assert resp["flashdraft"]["block_size"] == 4 and not marker.exists()


# ---------------------------------------------------------------- disconnects, the queue bound, timeouts

def test_disconnect_mid_stream_frees_the_slot(server, client):
    before = server.metrics()['flashdraft_requests_total{outcome="cancelled"}']
    stream = client.completions.create(model=MODEL, prompt="long", max_tokens=LONG, temperature=0, stream=True)
    got = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].text is not None for c in got)
    stream.close()
    wait_until(lambda: idle(server), 10, "the decoder to stop after the client left")  # long before LONG tokens
    assert server.metrics()['flashdraft_requests_total{outcome="cancelled"}'] == before + 1
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=5).usage.completion_tokens == 5


def test_disconnect_non_streaming_frees_the_slot(server, client):
    s = raw_post(server.port, "/v1/completions", {"model": MODEL, "prompt": "long", "max_tokens": LONG})
    wait_until(lambda: not idle(server), 15, "the request to start")
    s.close()
    wait_until(lambda: idle(server), 10, "the decoder to stop after the client left")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=5).usage.completion_tokens == 5


def test_queue_full_gets_429_never_a_hang(server):
    socks = [raw_post(server.port, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": LONG})
             for p in "abcde"]  # three decoding together (--max-batch 3), two waiting: the bound of --max-queue 2
    try:
        wait_until(lambda: server.request("GET", "/health")[1] | {"status": 0} == {"status": 0, "model": MODEL,
                                                                                  "queued": 2, "running": 3},
                   15, "three running, two waiting")
        assert server.metrics()["flashdraft_batch_size"] == 3
        before = server.metrics()['flashdraft_requests_total{outcome="rejected"}']
        t0 = time.monotonic()
        status, resp, headers = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "d"})
        assert status == 429 and time.monotonic() - t0 < 5
        assert resp["error"]["code"] == "queue_full" and resp["error"]["type"] == "rate_limit_error"
        assert headers.get("retry-after") == "1"
        with pytest.raises(openai.RateLimitError):
            client_for(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "e"}])
        assert server.metrics()['flashdraft_requests_total{outcome="rejected"}'] == before + 2
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: idle(server), 15, "every slot to be freed")


def test_request_timeout(tight):
    before = tight.metrics()['flashdraft_requests_total{outcome="timeout"}']
    t0 = time.monotonic()
    status, resp, _ = tight.request("POST", "/v1/completions", {"model": MODEL, "prompt": "t", "max_tokens": LONG})
    assert status == 504 and resp["error"]["code"] == "request_timeout" and 4.5 < time.monotonic() - t0 < 15
    stream = client_for(tight).completions.create(model=MODEL, prompt="t", max_tokens=LONG, stream=True)
    with pytest.raises(openai.APIError, match="request timeout"):
        for _ in stream:
            pass
    wait_until(lambda: idle(tight), 15, "the timed-out request to leave the decoder")
    assert tight.metrics()['flashdraft_requests_total{outcome="timeout"}'] == before + 2


# ---------------------------------------------------------------- SIGTERM

def test_sigterm_finishes_admitted_work_cancels_the_rest_and_exits_0(request, dirs):
    target, drafter = dirs
    srv = start(request, "--target", str(target), "--drafter", str(drafter), "--shutdown-timeout", "5")
    client = client_for(srv)
    # 1,000 tokens, so the long request joins while it runs: 200 took 0.15 s alone here and once ended before the
    # join in a full-suite run; 1,000 stay well inside --shutdown-timeout on a slower machine
    want = client.completions.create(model=MODEL, prompt="short", max_tokens=1000, temperature=0).choices[0].text
    short = client.completions.create(model=MODEL, prompt="short", max_tokens=1000, temperature=0, stream=True)
    first = next(iter(short))
    long = raw_post(srv.port, "/v1/completions", {"model": MODEL, "prompt": "long", "max_tokens": LONG})
    wait_until(lambda: srv.request("GET", "/health")[1]["running"] == 2, 15, "the long request to join the batch")
    srv.proc.terminate()
    try:  # new work is refused: 503 while draining, or no connection once the listener is closed
        status = srv.request("POST", "/v1/completions", {"model": MODEL, "prompt": "new"}, timeout=10)[0]
        assert status == 503
    except OSError:
        pass
    text = first.choices[0].text + "".join(c.choices[0].text for c in short)
    assert text == want  # the admitted request finished
    long.settimeout(30)
    reply = b""
    while chunk := long.recv(65536):
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 503") and b"shutting_down" in reply  # cancelled after --shutdown-timeout
    assert srv.proc.wait(30) == 0
    assert "server stopped" in "".join(srv.stderr)


# ---------------------------------------------------------------- load

def tiny_cases(dirs) -> list[Case]:
    target = flashdraft.load_target(str(dirs[0]))
    drafter = flashdraft.load_drafter_for(target, str(dirs[1]))
    cases = [Case(p, 24) for p in ("one", "two", "three")] + [Case("four", 24, 0.8, 3), Case("five", 24, 1.0, 9)]
    references(target, drafter, cases)
    return cases


def test_load_below_the_bound_all_correct(server, dirs):
    cases = tiny_cases(dirs)
    report = run_load(server.url, MODEL, cases, clients=3, requests_per_client=4)  # decoded together (--max-batch 3)
    s = report.summary()
    print("\nload below the bound:", json.dumps(s))
    assert s["requests"] == 12 and s["ok"] == 12 and not report.errors and not report.mismatches
    assert s["requests_per_s"] > 0 and s["latency_p99_s"] >= s["latency_p50_s"] >= s["ttft_p50_s"] > 0


def test_load_above_the_bound_only_429(tight, dirs):
    cases = tiny_cases(dirs)
    report = run_load(tight.url, MODEL, cases, clients=6, requests_per_client=2)  # capacity 1 + 1
    s = report.summary()
    print("\nload above the bound:", json.dumps(s))
    assert set(report.errors) == {429} and report.ok >= 2 and not report.mismatches
    assert s["requests"] == 12
    wait_until(lambda: idle(tight), 15, "the server to be idle")


# ---------------------------------------------------------------- concurrent requests share cycles

REQUESTS = {  # the `refs` runs as API requests: (kind, arguments)
    "chat": ("chat", dict(messages=[{"role": "user", "content": "Hello there"}], max_tokens=40, temperature=0)),
    "text": ("text", dict(prompt="abc def", max_tokens=33, temperature=0)),
    "ids": ("text", dict(prompt=[5, 9, 11, 40, 3], max_tokens=25, temperature=0)),
    "sampled": ("chat", dict(messages=[{"role": "user", "content": "Tell me"}], max_tokens=40, temperature=0.9,
                             top_p=0.9, seed=7, extra_body={"top_k": 20})),
}


def stream_text(server: Server, kind: str, kw: dict, first: threading.Event | None = None) -> tuple[str, dict]:
    """Stream one request → (its text, the flashdraft field of its last chunk); `first` is set at its first text."""
    api = client_for(server)
    create = api.chat.completions.create if kind == "chat" else api.completions.create
    parts, final = [], {}
    for c in create(model=MODEL, stream=True, **kw):
        piece = (c.choices[0].delta.content if kind == "chat" else c.choices[0].text) if c.choices else None
        if piece:
            parts.append(piece)
            if first is not None:
                first.set()
        if c.choices and c.choices[0].finish_reason:
            final = ext(c)
    return "".join(parts), final


class Concurrent:
    """The named REQUESTS streamed at once, one thread each: `first` is set at the first text of any, `out` holds
    each one's (text, flashdraft field)."""

    def __init__(self, server: Server, names: list[str]):
        self.out: dict[str, tuple[str, dict]] = {}
        self.first = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(server, n), daemon=True) for n in names]
        for t in self.threads:
            t.start()

    def run(self, server: Server, name: str) -> None:
        self.out[name] = stream_text(server, *REQUESTS[name], self.first)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout: float = 120) -> dict[str, tuple[str, dict]]:
        for t in self.threads:
            t.join(timeout)
        assert len(self.out) == len(self.threads), "a request failed (see the thread's traceback)"
        return self.out


def long_stream(server: Server, prompt: str = "long"):
    """A streaming request that would run for minutes, already decoding (its first chunk read)."""
    stream = client_for(server).completions.create(model=MODEL, prompt=prompt, max_tokens=LONG, temperature=0,
                                                   stream=True)
    next(iter(stream))
    return stream


def test_concurrent_streams_share_cycles_and_each_equals_generate(server, refs):
    """Adaptive widths (the default): four streams beside a long one decode in shared cycles, up to --max-batch 3 at
    once, and each answer equals its own `generate` run (greedy and seeded sampling)."""
    before = server.metrics()
    blocker = long_stream(server)
    runs, seen = Concurrent(server, list(REQUESTS)), 0
    while runs.alive():
        seen = max(seen, server.metrics()["flashdraft_batch_size"])
    for name, (text, x) in runs.join().items():
        assert x["output_ids"] == refs[name]["output_ids"] and text == refs[name]["text"], name
        assert x["batch"] >= 2, name  # every cycle of it had the long request beside it
    m = server.metrics()
    blocker.close()
    assert 2 <= seen <= 3 and m["flashdraft_max_batch"] == 3 and m["flashdraft_tokens_per_second"] > 0
    steps = m["flashdraft_step_batch_size_count"] - before["flashdraft_step_batch_size_count"]
    rows = m["flashdraft_step_batch_size_sum"] - before["flashdraft_step_batch_size_sum"]
    assert rows > steps > 0 and m['flashdraft_step_batch_size_bucket{le="4"}'] == m["flashdraft_step_batch_size_count"]
    wait_until(lambda: idle(server), 10, "the long request to leave")


def test_cancelling_one_stream_leaves_the_others_and_fixed_cycles_equal_generate(fixed, refs):
    """--fixed-block: batched cycles equal `generate`'s cycle for cycle, while one stream of the batch is dropped."""
    before = fixed.metrics()['flashdraft_requests_total{outcome="cancelled"}']
    doomed = long_stream(fixed)
    runs = Concurrent(fixed, list(REQUESTS))
    assert runs.first.wait(60)
    doomed.close()  # while the others are decoding beside it
    for name, (text, x) in runs.join().items():
        rec = refs[name]
        assert x["output_ids"] == rec["output_ids"] and text == rec["text"], name
        assert x["acceptance_lengths"] == rec["acceptance_lengths"], name
    wait_until(lambda: idle(fixed), 10, "the cancelled request to leave the batch")
    assert fixed.metrics()['flashdraft_requests_total{outcome="cancelled"}'] == before + 1


def test_a_timeout_leaves_the_others(fixed):
    """--request-timeout 8: the request admitted first times out while the one beside it keeps decoding."""
    want = client_for(fixed).completions.create(model=MODEL, prompt="go on", max_tokens=300, temperature=0)
    want = want.choices[0].text
    late: dict = {}
    waiter = threading.Thread(target=lambda: late.update(r=fixed.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "late", "max_tokens": LONG}, timeout=60)))
    waiter.start()
    wait_until(lambda: fixed.request("GET", "/health")[1]["running"] == 1, 15, "the first request to start")
    time.sleep(2)  # so that the second request's deadline comes 2 s after the first's
    stream = client_for(fixed).completions.create(model=MODEL, prompt="go on", max_tokens=LONG, temperature=0,
                                                  stream=True)
    chunks, text = iter(stream), ""
    while waiter.is_alive():  # both decode until the first times out
        text += next(chunks).choices[0].text
    assert late["r"][0] == 504 and late["r"][1]["error"]["code"] == "request_timeout"
    after = "".join(next(chunks).choices[0].text for _ in range(5))  # the second goes on
    stream.close()
    text += after
    n = min(len(text), len(want))
    assert text[:n] == want[:n] and n >= 50
    wait_until(lambda: idle(fixed), 10, "the second request to leave")


def test_max_batch_1_decodes_one_request_at_a_time(tight, refs):
    runs = Concurrent(tight, ["chat", "ids"])  # --max-batch 1 --max-queue 1: one decodes, one waits
    for name, (text, x) in runs.join().items():
        assert x["output_ids"] == refs[name]["output_ids"] and text == refs[name]["text"] and x["batch"] == 1
    m = tight.metrics()
    assert m["flashdraft_max_batch"] == 1
    assert m['flashdraft_step_batch_size_bucket{le="1"}'] == m["flashdraft_step_batch_size_count"] > 0


# ---------------------------------------------------------------- text tracking (no server)

def test_text_tracker_holds_back_partial_stop_strings_and_characters():
    dec = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731 (ids are bytes)
    t = TextTracker(dec, ["END"])
    assert t.add(list(b"ab")) == "ab"
    assert t.add(list(b"cE")) == "c"  # "E" may start "END"
    assert t.add(list(b"x") + [0xC3]) == "Ex"  # half of "é" waits
    assert t.add([0xA9] + list(b"EN")) == "é"
    assert t.add(list(b"Dzz")) == "" and t.stopped and t.text == "abcEx\u00e9" and t.finish() == ""
    assert bytes(t.ids) == "abcExéEND".encode()  # the block ran past the stop: cut to the fewest ids


def test_text_tracker_without_stops_sends_everything():
    t = TextTracker(lambda ids: "".join(chr(97 + i) for i in ids), [])
    assert [t.add([0, 1]), t.add([2]), t.finish()] == ["ab", "c", ""] and not t.stopped


def test_text_tracker_follows_a_tokenizer_that_rewrites_earlier_text():
    """Decoding more ids rewrites earlier characters here (a space before punctuation is cleaned up, as
    clean_up_tokenization_spaces does, and the text's first space is dropped, as SentencePiece does): the streamed
    text still equals the full decode, where slicing the full decode by the characters already sent does not."""
    vocab = [" Hello", " world", " ", ".", ",", " how", " are", " you", "?", "\n", "\u00e9"]

    def dec(ids):
        text = "".join(vocab[i] for i in ids)
        for p in ".,?":
            text = text.replace(" " + p, p)
        return text.removeprefix(" ")

    ids = [0, 1, 2, 4, 5, 6, 2, 7, 2, 8, 9, 0, 2, 3, 10, 2, 2, 3, 2]
    for k in (1, 2, 3, 5):
        t = TextTracker(dec, ["you?"] if k == 5 else [])
        deltas = [t.add(ids[i:i + k]) for i in range(0, len(ids), k) if not t.stopped]
        deltas.append(t.finish())
        assert "".join(deltas) == t.text == (dec(ids) if k != 5 else "Hello world, how are  "), k
        assert t.stopped or all(not d[-1:].isspace() for d in deltas[:-1])  # a trailing space waits for the next
    assert dec(t.ids) == "Hello world, how are  you?" and len(t.ids) == 10  # cut to the ids that contain the stop
    sent = ""
    for i in range(1, len(ids) + 1):
        sent += dec(ids[:i])[len(sent):]
    assert sent != dec(ids)  # what slicing the whole decode would have sent


def test_text_tracker_decodes_a_bounded_window_per_cycle():
    """The work per cycle does not grow with the output: at most two decodes of the last few cycles' ids."""
    lengths: list[int] = []

    def dec(ids):
        lengths.append(len(ids))
        return bytes(ids).decode("utf-8", errors="replace")

    t, text = TextTracker(dec, ["STOP"]), "abc \u00e9d€ " * 300  # multi-byte characters split across cycles
    data, out = list(text.encode()), []
    for i in range(0, len(data), 4):
        lengths.clear()
        out.append(t.add(data[i:i + 4]))
        assert len(lengths) <= 2 and max(lengths) <= HOLD_IDS + 4  # of 3300 ids in the end
    assert "".join(out) + t.finish() == text and t.text == text and len(data) == 3300


def test_each_thread_gets_its_own_tokenizer_copy():
    tokens, seen = PerThread(char_tokenizer()), {}

    def work(i: int) -> None:
        tok = tokens.get()
        assert tokens.get() is tok and tok is not tokens.base
        seen[i] = (tok, {tokens.decode(tok("abc def")["input_ids"]) for _ in range(200)})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(tok) for tok, _ in seen.values()}) == 4 and all(d == {"abc def"} for _, d in seen.values())


# ---------------------------------------------------------------- command line

@pytest.mark.parametrize("args,match", [
    (["--engine", "llama.cpp"], "does not serve: choose torch"),
    (["--port", "70000"], "--port must be in"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--max-batch", "0"], "--max-batch must be > 0"),
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be > 0"),
    (["--block-size", "0"], "block size must be >= 1"),
    (["--target", "/nonexistent/model"], "not a model directory"),
])
def test_serve_bad_options_one_line_exit_2(capsys, args, match):
    assert main(["serve", *args]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("flashdraft: error:") and match in lines[0], lines


def test_port_in_use_is_one_line(capsys, dirs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"flashdraft: error: cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


# ---------------------------------------------------------------- the default target

@pytest.mark.slow
def test_default_target_serves_lossless_and_under_load(request):
    srv = start(request)
    model = srv.request("GET", "/v1/models")[1]["data"][0]["id"]
    assert model == "smollm2-135m-instruct"
    client = client_for(srv, timeout=300)
    prompts = ["What is 17 * 23?", "Name three colors."]
    for prompt in prompts:
        rec = cli_generate(None, None, prompt, "--max-new-tokens", "32", "--temperature", "0")
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0)
        resp = client.chat.completions.create(**kw)
        assert ext(resp)["output_ids"] == rec["output_ids"] and resp.choices[0].message.content == rec["text"]
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert streamed == rec["text"]
    target = flashdraft.load_target()
    cases = [Case(p, 32) for p in prompts]
    references(target, flashdraft.load_drafter_for(target, None), cases)
    report = run_load(srv.url, model, cases, clients=2, requests_per_client=2)
    print("\ndefault target load:", json.dumps(report.summary()))
    assert report.ok == 4 and not report.errors and not report.mismatches
