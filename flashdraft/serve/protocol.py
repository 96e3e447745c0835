"""The OpenAI wire format: request validation into a GenRequest, response and error bodies."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import target as T
from ..decoding import GenerationResult
from ..models import Target
from .worker import GenRequest, PerThread


class ApiError(Exception):
    """An error the client gets as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_STOPS = 4  # as the OpenAI API
MAX_STOP_CHARS = 256  # a stop string is matched against every cycle's new text: its length bounds that work
MAX_SEED = 2 ** 63 - 1
MAX_TEMPERATURE = 100.0  # sampling is uniform noise long before this; beyond it logits / T stops being finite
MAX_TOP_K = 2 ** 31 - 1


class _Strict(BaseModel):
    # strict: "5" is not an int and true is not a number; unknown fields are ignored (clients send many);
    # allow_inf_nan=False: 1e309 parses as infinity and NaN is Python's JSON, and neither may reach the sampler
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class Common(_Strict):
    # the ranges are checked here and published in the OpenAPI schema; the context bound is checked in _max_tokens
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="0 or -1 = off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="default: a fresh one, returned")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
                                                           "characters")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="vLLM's extension: decode past end-of-sequence tokens, to exactly "
                                                "max_tokens (stop strings still apply)")


class ChatRequest(Common):
    messages: list[Message]


class CompletionRequest(Common):
    prompt: str | list[int] | list[str]


# fields that would change the answer if silently ignored: the values that mean "off" are accepted; the rest get a 400
# naming the field (fields that do not change the answer, such as user, metadata, store or stream_options, pass)
OFF, NONE, FALSE, EMPTY = (None,), (None, False, 0), (None, False), (None, [], {}, "")
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "echo": FALSE, "suffix": EMPTY, "logprobs": NONE, "top_logprobs": NONE,
    "prompt_logprobs": OFF, "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "length_penalty": (None, 1), "logit_bias": EMPTY, "min_p": (None, 0),
    "typical_p": (None, 1), "min_tokens": (None, 0), "use_beam_search": FALSE,
    "stop_token_ids": EMPTY, "bad_words": EMPTY, "allowed_token_ids": OFF, "include_stop_str_in_output": FALSE,
    "skip_special_tokens": (None, True), "response_format": (None, {"type": "text"}), "tools": EMPTY,
    "functions": EMPTY, "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "structured_outputs": OFF, "logits_processors": EMPTY, "prediction": OFF, "audio": OFF,
    "modalities": (None, ["text"]), "web_search_options": OFF, "chat_template": OFF, "chat_template_kwargs": EMPTY,
    "add_generation_prompt": (None, True), "continue_final_message": FALSE, "documents": EMPTY,
}
UNSUPPORTED_PREFIXES = ("guided_",)  # vLLM's guided_json, guided_regex, guided_choice, guided_grammar, …


@dataclass
class Served:
    """What requests are checked against: the served model ids, the target and the server's defaults."""

    ids: list[str]
    target: Target
    default_max_tokens: int = 256
    tokens: PerThread | None = field(default=None, repr=False)  # per-thread tokenizer copies (default: own ones)

    def __post_init__(self) -> None:
        self.tokens = self.tokens or PerThread(self.target.tokenizer)

    @property
    def context(self) -> int:
        return T.context_limit(self.target.model)

    @property
    def vocab(self) -> int:
        return T.vocab_size(self.target.model)


@dataclass
class Parsed:
    """A validated request: what to generate and how to answer."""

    gen: GenRequest
    stream: bool
    include_usage: bool
    model: str


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _validate(cls: type[BaseModel], body: dict) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        raise ApiError(400, f"{'.'.join(loc) or 'body'}: {err['msg']}", param=loc[0] if loc else None) from None


def _same(value: Any, off: Any) -> bool:
    """value == off, where a bool only equals a bool (n=true is not n=1)."""
    return isinstance(value, bool) == isinstance(off, bool) and value == off


def _check_unsupported(body: dict) -> None:
    for name, value in body.items():
        off = UNSUPPORTED.get(name, OFF if name.startswith(UNSUPPORTED_PREFIXES) else None)
        if off is not None and value is not None and not any(_same(value, v) for v in off):
            raise ApiError(400, f"{name}={json.dumps(value)} is not supported by this server", param=name,
                           code="unsupported_parameter")


def _check_model(req: Common, served: Served) -> str:
    """The model field is only compared with the served ids: it never names a file or loads anything."""
    if req.model is None:
        return served.ids[0]
    if req.model not in served.ids:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {served.ids[0]!r}",
                       param="model", code="model_not_found")
    return req.model


def _sampling(req: Common) -> tuple[float, float, int, int]:
    """The request's sampling settings with the defaults filled in (their ranges were checked with the model)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k in (None, -1) else req.top_k  # -1 (vLLM) and 0 both disable top-k
    seed = secrets.randbelow(MAX_SEED) if req.seed is None else req.seed  # no seed: a fresh draw, as OpenAI
    return temperature, top_p, top_k, seed


def _stops(req: Common) -> list[str]:
    stops = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop strings may have at most {MAX_STOP_CHARS} characters, got one of "
                            f"{max(map(len, stops))}", param="stop")
    return stops


def _max_tokens(req: Common, served: Served, n_prompt: int, prompt_param: str) -> int:
    ctx = served.context
    if n_prompt >= ctx:
        raise ApiError(400, f"the prompt has {n_prompt} tokens but the model's context is {ctx}; shorten it so at "
                            "least one new token fits", param=prompt_param, code="context_length_exceeded")
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if given is None:
        return min(served.default_max_tokens, ctx - n_prompt)
    if given < 1:
        raise ApiError(400, f"{param} must be >= 1, got {given}", param=param)
    if n_prompt + given > ctx:
        raise ApiError(400, f"the model's context is {ctx} tokens: {n_prompt} in the prompt + {param} {given} do "
                            f"not fit (at most {ctx - n_prompt})", param=param, code="context_length_exceeded")
    return given


def _tokenizer(served: Served):
    """This thread's copy of the tokenizer (requests are parsed in a thread pool)."""
    tok = served.tokens.get()
    if tok is None:
        raise ApiError(400, "the served target has no tokenizer: send token ids as the prompt of /v1/completions",
                       param="prompt")
    return tok


def chat_ids(messages: list[Message], served: Served) -> list[int]:
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    tok = _tokenizer(served)
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "the served target has no chat template: use /v1/completions", param="messages")
    turns = [{"role": "system" if m.role == "developer" else m.role,
              "content": m.content if isinstance(m.content, str) else
              "\n".join(p.text for p in m.content or [])} for m in messages]
    try:  # transformers renders the (server-side) template in a sandbox; client text is only data in it
        ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def completion_ids(prompt: str | list[int] | list[str], served: Served) -> list[int]:
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt) and prompt:
        if len(prompt) > 1:
            raise ApiError(400, "one prompt per request (a list of prompts is not supported)", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        ids = replace(served.target, tokenizer=_tokenizer(served)).encode(prompt, chat=False)
        if not ids:  # text the tokenizer drops entirely (whitespace, control characters)
            raise ApiError(400, "the prompt is empty once tokenized; send some text", param="prompt")
        return ids
    bad = [i for i in prompt if not 0 <= i < served.vocab]
    if bad:
        raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary 0..{served.vocab - 1}",
                       param="prompt")
    return list(prompt)


def parse(kind: str, body: dict, served: Served) -> Parsed:
    """Validate a /v1/chat/completions ("chat") or /v1/completions ("text") body."""
    _check_unsupported(body)
    req = _validate(ChatRequest if kind == "chat" else CompletionRequest, body)
    model = _check_model(req, served)
    temperature, top_p, top_k, seed = _sampling(req)
    stops = _stops(req)
    ids = chat_ids(req.messages, served) if kind == "chat" else completion_ids(req.prompt, served)
    max_tokens = _max_tokens(req, served, len(ids), "messages" if kind == "chat" else "prompt")
    gen = GenRequest(ids, max_tokens, temperature, top_p, top_k, seed, stops, req.ignore_eos)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return Parsed(gen, req.stream, usage, model)


# ---------------------------------------------------------------- responses

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(gen: GenRequest, out: GenerationResult) -> dict:
    n = len(out.output_ids)
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": n, "total_tokens": len(gen.prompt_ids) + n}


def extension(gen: GenRequest, out: GenerationResult, block_size: int) -> dict:
    """The flashdraft field: τ, acceptance lengths, the timing split, what exactly was decoded, and the most
    sequences its cycles were batched with."""
    return {"tau": out.tau, "acceptance_lengths": out.acceptance_lengths,
            "timing": asdict(out.timing) | {"queue_s": out.extras["queue_s"]}, "output_ids": out.output_ids,
            "block_size": block_size, "seed": gen.seed, "batch": out.extras["batch"]}


def completion_body(kind: str, rid: str, model: str, created: int, gen: GenRequest, out: GenerationResult,
                    block_size: int) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "finish_reason": out.extras["finish_reason"], "logprobs": None}
    else:
        choice = {"index": 0, "text": out.text, "finish_reason": out.extras["finish_reason"], "logprobs": None}
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(gen, out),
            "flashdraft": extension(gen, out, block_size)}


def chunk_body(kind: str, rid: str, model: str, created: int, text: str | None = None, role: bool = False,
               finish: str | None = None) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def unix_time() -> int:
    """Seconds since the epoch, as the OpenAI bodies' `created` field has them."""
    return int(time.time())
