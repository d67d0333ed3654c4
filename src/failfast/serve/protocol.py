"""OpenAI request bodies -> engine requests, and engine results -> OpenAI response bodies.

Parsing is strict, as OpenAI's own API is: a wrong type, an out-of-range value, an unknown
field or a feature the engine does not have (`n` > 1, logprobs, tools, logit_bias, ...) is a
`BadRequest` naming the parameter, never silently ignored. Defaults follow OpenAI's
(temperature 1, top_p 1, 16 tokens for completions); a sampled request without a seed
draws a fresh one, so only seeded requests repeat.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from failfast.decode.engine import GenerationResult
from failfast.decode.sampling import SamplingParams
from failfast.errors import FailfastError

MAX_STOPS = 4
COMPLETION_DEFAULT_MAX_TOKENS = 16
# fields a client may send that change nothing here
IGNORED = {"model", "user", "metadata", "store"}
# fields that name features this engine does not have, with the only value that is accepted
UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
               "logit_bias": None, "tools": None,
               "tool_choice": None, "functions": None, "function_call": None, "parallel_tool_calls": None,
               "response_format": None}
COMMON = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "presence_penalty", "frequency_penalty", "repetition_penalty"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}


class BadRequest(FailfastError):
    """A request the server refuses, with OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Limits:
    context: int     # the target's positions: prompt + new tokens
    max_tokens: int  # the most new tokens one request may ask for


@dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _text(value: str, name: str) -> str:
    """A string that is valid Unicode text (JSON escapes can carry lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name} is not valid Unicode text (a lone surrogate?)", name) from None
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, open_lo: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
            (lo < value if open_lo else lo <= value) and value <= hi):
        raise BadRequest(f"{name} must be a number in {'(' if open_lo else '['}{lo}, {hi}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is not None and (not _is_int(value) or value < lo):
        raise BadRequest(f"{name} must be an integer >= {lo}, got {value!r}", name)
    return value


def _check_fields(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name, accepted in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != accepted and not (name == "logprobs" and value is False):
            raise BadRequest(f"{name}={value!r} is not supported by this server", name)
    unknown = set(body) - allowed - IGNORED - set(UNSUPPORTED)
    if unknown:
        raise BadRequest(f"unrecognized request arguments: {', '.join(sorted(unknown))}", sorted(unknown)[0])


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return tuple(_text(s, "stop") for s in stops)


def _common(body: dict, prompt_ids: list[int], limits: Limits, default_max: int,
            max_name: str = "max_tokens") -> ParsedRequest:
    if not prompt_ids:
        raise BadRequest("the prompt is empty", "prompt")
    max_tokens = _integer(body, max_name, 1)
    if max_tokens is None:
        max_tokens = max(1, min(default_max, limits.max_tokens, limits.context - len(prompt_ids)))
    if max_tokens > limits.max_tokens:
        raise BadRequest(f"{max_name} is at most {limits.max_tokens} on this server, got {max_tokens}", max_name)
    if len(prompt_ids) + max_tokens > limits.context:
        raise BadRequest(f"the prompt ({len(prompt_ids)} tokens) plus {max_name} ({max_tokens}) exceeds the "
                         f"model's context of {limits.context} tokens", max_name)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True)
    top_k = _integer(body, "top_k", 0) or 0
    penalties = dict(presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                     frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                     repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 2.0, open_lo=True))
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
    if seed is None:
        seed = secrets.randbits(63) if temperature > 0 else 0
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("stream_options supports only include_usage", "stream_options")
    if options and not stream:
        raise BadRequest("stream_options needs stream=true", "stream_options")
    return ParsedRequest(prompt_ids, max_tokens, SamplingParams(temperature, top_k, top_p, seed, **penalties),
                         _stops(body),
                         stream, bool(options.get("include_usage")))


def parse_completion(body: Any, encode: Callable[[str], list[int]], vocab_size: int, limits: Limits) -> ParsedRequest:
    """A `/v1/completions` body: one prompt, as text or token ids."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = encode(_text(prompt, "prompt"))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        ids = list(prompt)
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    return _common(body, ids, limits, COMPLETION_DEFAULT_MAX_TOKENS)


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The messages with their content as plain text (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a role and a content", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest("only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest("a message's content must be a string or a list of text parts", "messages")
        out.append({"role": _text(m["role"], "messages"), "content": _text(content, "messages")})
    return out


def parse_chat(body: Any, render: Callable[[list[dict[str, str]]], str], encode: Callable[[str], list[int]],
               limits: Limits) -> ParsedRequest:
    """A `/v1/chat/completions` body: messages rendered by the model's chat template."""
    _check_fields(body, CHAT_FIELDS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ids = encode(render(chat_messages(body)))
    return _common(body, ids, limits, limits.context, name)


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.stop_reason == "length" else "stop"


def usage(prompt_tokens: int, result: GenerationResult) -> dict[str, int]:
    n = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def speculation(result: GenerationResult) -> dict[str, Any]:
    """The extra `failfast` field: output ids, why it stopped, the speculative statistics."""
    return {"token_ids": result.token_ids, "stop_reason": result.stop_reason, "stats": result.stats.to_dict()}


class ResponseIds:
    """id / object / created / model of one response and all its chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def full_response(ids: ResponseIds, prompt_tokens: int, result: GenerationResult) -> dict[str, Any]:
    text = result.text or ""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(result), "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if ids.chat else {"text": text})
    return {**ids.head(False), "choices": [choice], "usage": usage(prompt_tokens, result),
            "failfast": speculation(result)}


def text_chunk(ids: ResponseIds, text: str, first: bool = False) -> dict[str, Any]:
    if ids.chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
    return {**ids.head(True), "choices": [choice]}


def final_chunk(ids: ResponseIds, result: GenerationResult) -> dict[str, Any]:
    chunk = text_chunk(ids, "")
    chunk["choices"][0]["finish_reason"] = finish_reason(result)
    if ids.chat:
        chunk["choices"][0]["delta"] = {}
    chunk["failfast"] = speculation(result)
    return chunk


def usage_chunk(ids: ResponseIds, prompt_tokens: int, result: GenerationResult) -> dict[str, Any]:
    return {**ids.head(True), "choices": [], "usage": usage(prompt_tokens, result)}
