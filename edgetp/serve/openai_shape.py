"""OpenAI's wire format: request fields checked one by one, answers and SSE chunks shaped as OpenAI's.

Pure functions and small values, no I/O except reading a request body;
`api.py` calls them. Every refusal is an `ApiError` whose message names the
field and says what was wrong.
"""

from __future__ import annotations

import json
import time
import dataclasses
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from edgetp.model.sampling import MAX_LOGPROBS, Logprobs, SamplingError, SamplingParams
from edgetp.model.tokenizer import StreamDecoder, Tokenizer

DONE = b"data: [DONE]\n\n"
MAX_STOP = 4  # as OpenAI
MAX_N = 128  # choices per request, as OpenAI
ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH = {"stop": "stop", "length": "length", "context": "length"}  # ours -> OpenAI's


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response({"error": error_body(self.message, self.type, self.param, self.code)},
                                 status=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"message": message, "type": type, "param": param, "code": code}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


def sse_error(message: str) -> bytes:
    """The event that ends a stream which failed after it began (the openai client raises it as APIError)."""
    return sse({"error": error_body(message, "server_error", None, None)})


async def json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # one it cannot read is a 400 (api._errors)
    try:
        body = json.loads(raw)
    except ValueError as exc:  # bad JSON or UTF-8, or an integer of more digits than Python converts
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}")
    return body


# --------------------------------------------------------------------------- fields


def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, not {_kind(v)}", param=name, code="invalid_type")
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' is {v}; it must be between {lo} and {hi}", param=name,
                       code="invalid_value")
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, not {_kind(v)}", param=name, code="invalid_type")
    return v


def _boolean(body: dict, name: str, where: str | None = None) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        where = where or name
        raise ApiError(400, f"'{where}' must be a boolean, not {_kind(v)}", param=where, code="invalid_type")
    return v


@dataclass(frozen=True)
class Options:
    params: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool = False  # a completion's answer starts with its prompt (scored too, with logprobs)
    n: int = 1  # choices: each its own sequence, choice i seeded seed + i (see `seeded`)
    max_name: str = "max_tokens"  # the field max_tokens came from (chat's max_completion_tokens too)

    def seeded(self, i: int) -> SamplingParams:
        """Choice i's sampling: with a seed, seed + i, so choice i is what n=1 gives with that seed."""
        if i == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=(self.params.seed + i) % 2**64)


def options(body: dict, model_name: str, *, chat: bool) -> Options:
    """Everything but the prompt. Unset sampling fields keep SamplingParams' defaults (llama.cpp's)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, not {_kind(model)}", param="model", code="invalid_type")
    if model not in (None, model_name):  # a 404, as OpenAI's (and GET /v1/models/{model}'s)
        raise ApiError(404, f"the model {model!r} does not exist; this server has {model_name!r}",
                       param="model", code="model_not_found")
    n = _integer(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' is {n}; it must be between 1 and {MAX_N}", param="n", code="invalid_value")
    max_tokens = _integer(body, "max_tokens")  # checked even when chat's max_completion_tokens overrides it
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_name)
    echo = False if chat else _boolean(body, "echo")
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise ApiError(400, f"'{max_name}' is {max_tokens}; it must be at least 1 (0 only with 'echo')",
                       param=max_name, code="invalid_value")
    fields = {"temperature": _number(body, "temperature", 0, 2), "top_p": _number(body, "top_p", 0, 1),
              "min_p": _number(body, "min_p", 0, 1), "repeat_penalty": _number(body, "repeat_penalty", 0, 10),
              "top_k": _integer(body, "top_k"), "seed": _integer(body, "seed"),
              "frequency_penalty": _number(body, "frequency_penalty", -2, 2),
              "presence_penalty": _number(body, "presence_penalty", -2, 2),
              "logit_bias": _logit_bias(body.get("logit_bias")), "logprobs": _logprobs(body, chat)}
    _unsupported(body, chat)
    if fields["seed"] is not None:
        fields["seed"] %= 2**64  # OpenAI takes any integer; numpy's generator wants one >= 0
    try:
        params = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except SamplingError as exc:
        param = next((k for k in fields if k in str(exc)), None)
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    stream = _boolean(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise ApiError(400, f"'stream_options' must be an object, not {_kind(so)}", param="stream_options",
                       code="invalid_type")
    include_usage = _boolean(so or {}, "include_usage", "stream_options.include_usage")
    return Options(params, max_tokens, _stop(body.get("stop")), stream, stream and include_usage, echo, n or 1,
                   max_name)


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias in [-100, 100]}; the ids are checked against the vocabulary by the caller."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ApiError(400, f"'logit_bias' must be an object, not {_kind(v)}", param="logit_bias", code="invalid_type")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12):  # not "²": int() refuses it
            raise ApiError(400, f"'logit_bias' keys are token ids, got {k!r}", param="logit_bias", code="invalid_value")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise ApiError(400, f"'logit_bias[{k}]' is {b!r}; it must be a number between -100 and 100",
                           param="logit_bias", code="invalid_value")
        out.append((int(k), float(b)))
    return tuple(out) or None


def _logprobs(body: dict, chat: bool) -> int | None:
    """SamplingParams.logprobs: chat's `logprobs` (a boolean) with `top_logprobs` (alternatives), or a
    completion's `logprobs` (the alternatives; 0: the answered tokens' alone). None: not asked."""
    if not chat:
        n = _integer(body, "logprobs")
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise ApiError(400, f"'logprobs' is {n}; it must be between 0 and {MAX_LOGPROBS}", param="logprobs",
                           code="invalid_value")
        return n
    on = _boolean(body, "logprobs")
    n = _integer(body, "top_logprobs")
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' is {n}; it must be between 0 and {MAX_LOGPROBS}", param="top_logprobs",
                       code="invalid_value")
    if n and not on:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs", code="invalid_value")
    return (n or 0) if on else None


# fields whose answer this server cannot give, refused rather than ignored: the client would take an
# answer without them for one with them (field -> the values that ask for nothing)
_NOT_GIVEN = {"suffix": (None, ""), "best_of": (None, 1), "tools": (None, []), "functions": (None, []),
              "tool_choice": (None, "none"), "function_call": (None, "none")}


def _unsupported(body: dict, chat: bool) -> None:
    for name, nothing in (_NOT_GIVEN | {"echo": (None, False)} if chat else
                          _NOT_GIVEN | {"top_logprobs": (None, 0)}).items():
        v = body.get(name)
        if not any(v is x or (type(v) is type(x) and v == x) for x in nothing):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported by this server",
                       param="response_format", code="unsupported_parameter")


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"'stop' has {len(stops)} sequences; at most {MAX_STOP} are allowed", param="stop",
                       code="invalid_value")
    return tuple(s for s in stops if s)


def messages(v: Any) -> list[dict[str, str]]:
    """OpenAI chat messages as the template wants them: role and plain-text content."""
    if v is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(v, list):
        raise ApiError(400, f"'messages' must be an array, not {_kind(v)}", param="messages", code="invalid_type")
    if not v:
        raise ApiError(400, "'messages' is empty; send at least one message", param="messages",
                       code="invalid_value")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object, not {_kind(m)}", param=where, code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"'{where}.role' is {role!r}; it must be one of {', '.join(ROLES)}",
                           param=f"{where}.role", code="invalid_value")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(m.get("content"), f"{where}.content")})
    return out


def _text(s: str, where: str) -> str:
    """s, if it is text: a JSON string's \\u escapes may carry half of a UTF-16 pair, which is no character."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"'{where}' holds a lone UTF-16 surrogate (U+{ord(s[exc.start]):04X} at character "
                            f"{exc.start}), which is not text", param=where, code="invalid_value") from None
    return s


def _content(c: Any, where: str) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return _text(c, where)
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return _text("".join(p["text"] for p in c), where)
    raise ApiError(400, f"'{where}' must be a string or an array of text parts", param=where,
                   code="invalid_type")


def prompt(v: Any, tok: Tokenizer) -> tuple[str, list[int]]:
    """A completion prompt: a string, one string in an array, or an array of token ids."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        text = _text(v, "prompt")
        ids = tok.encode(text, add_special=True, parse_special=False)
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if not all(0 <= t < tok.vocab_size for t in v):
            raise ApiError(400, f"'prompt' has token ids outside 0..{tok.vocab_size - 1}", param="prompt",
                           code="invalid_value")
        ids, text = list(v), tok.decode(v)
    elif v is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    elif isinstance(v, list) and len(v) > 1 and all(isinstance(p, str) for p in v):
        raise ApiError(400, f"'prompt' has {len(v)} prompts; this server takes one per request", param="prompt",
                       code="invalid_value")
    else:
        raise ApiError(400, "'prompt' must be a string or an array of token ids", param="prompt",
                       code="invalid_type")
    if not ids:
        raise ApiError(400, "'prompt' is empty", param="prompt", code="invalid_value")
    return text, ids


def fit(prompt_tokens: int, max_tokens: int | None, ctx: int, param: str, max_name: str = "max_tokens") -> int:
    """max_tokens that fit the context (all the room left when unset), or a 400 saying why not."""
    if prompt_tokens >= ctx:
        subject = "the prompt" if param == "prompt" else f"the prompt ('{param}')"
        raise ApiError(400, f"{subject} has {prompt_tokens} tokens but the context holds {ctx}, "
                       f"leaving no room for an answer", param=param, code="context_length_exceeded")
    room = ctx - prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise ApiError(400, f"'{max_name}' is {max_tokens} but the context holds {ctx} tokens and the prompt "
                       f"takes {prompt_tokens}: at most {room} can be generated", param=max_name,
                       code="context_length_exceeded")
    return max_tokens


# --------------------------------------------------------------------------- answers


def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "edgetp"}


class Shaper:
    """Answers and stream chunks of one choice of a request, chat ("chat") or completion ("text"). With
    `tok`, each answer or chunk carries the log probabilities of its tokens (the request asked for them).
    `choice(i)` shapes the request's choice i (`n`): the same id, its own index and text offsets."""

    def __init__(self, kind: str, id: str, model: str, *, include_usage: bool = False,
                 tok: Tokenizer | None = None, index: int = 0) -> None:
        self.kind, self.id, self.model, self.include_usage = kind, id, model, include_usage
        self.created = int(time.time())
        self.tok, self.index = tok, index
        # a completion's text_offset: where each token's text starts in the answer's text
        self._offset, self._decoder = 0, None if tok is None else StreamDecoder(tok)
        self._echoed, self._end = 0, 0  # prompt tokens still to come of an echo, and its text's length

    def choice(self, index: int) -> Shaper:
        out = Shaper(self.kind, self.id, self.model, include_usage=self.include_usage, tok=self.tok, index=index)
        out.created = self.created
        return out

    def echoing(self, text: str, tokens: int) -> None:
        """The answer starts with the prompt `text` of `tokens` tokens: their offsets are into `text`
        as decoding the prompt gives it (an SPM prompt's first token's space is not in it)."""
        self._decoder = StreamDecoder(self.tok, strip_prefix=True)
        self._echoed, self._end = tokens, len(text)

    def _text_offset(self, tid: int) -> int:
        at = self._offset
        self._offset += len(self._decoder.feed(tid))
        if self._echoed:
            self._echoed -= 1
            if not self._echoed:  # the answer follows the prompt's text as sent back
                self._offset, self._decoder = self._end, StreamDecoder(self.tok)
        return at

    def _token(self, tid: int) -> tuple[str, list[int]]:
        raw = self.tok.token_bytes(tid)
        return raw.decode("utf-8", "replace"), list(raw)

    def logprobs(self, lps: list[Logprobs]) -> dict[str, Any] | None:
        """OpenAI's logprobs object of these tokens: chat's `content` list, or a completion's four lists."""
        if self.tok is None:
            return None
        if self.kind == "chat":
            def entry(tid: int, lp: float) -> dict[str, Any]:
                text, raw = self._token(tid)
                return {"token": text, "logprob": lp, "bytes": raw}
            return {"content": [entry(p.token, p.logprob) | {"top_logprobs": [entry(t, v) for t, v in p.top]}
                                for p in lps], "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for p in lps:  # (an echoed prompt's first token has no logprob nor top: null, as OpenAI's)
            text = self._token(p.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(p.logprob)
            out["top_logprobs"].append(None if p.top is None else {self._token(t)[0]: v for t, v in p.top})
            out["text_offset"].append(self._text_offset(p.token))
        return out

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def answer(self, text: str, reason: str | None, logprobs: list[Logprobs] = ()) -> dict[str, Any]:
        """This choice of a whole answer."""
        finish = FINISH.get(reason or "", None)
        lp = self.logprobs(list(logprobs))
        if self.kind == "chat":
            return {"index": self.index, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": lp, "finish_reason": finish}
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}

    def whole(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0) -> dict[str, Any]:
        """The whole answer of `choices` (`answer`s); completion_tokens: of every choice together."""
        out = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        return out | {"choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, text: str, reason: str | None, *, first: bool = False,
              logprobs: list[Logprobs] = ()) -> dict[str, Any]:
        """A stream chunk; `logprobs`: of the tokens whose text it carries (none: null)."""
        finish = FINISH.get(reason, "stop") if reason is not None else None
        lp = self.logprobs(list(logprobs)) if logprobs else None
        if self.kind == "chat":
            delta: dict[str, Any] = {} if reason is not None else {"content": text}
            if first:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        return head | {"choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held (not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
