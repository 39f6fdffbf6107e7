"""The OpenAI-compatible HTTP API over an :class:`Engine`: FastAPI on uvicorn, server-sent events for streams.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). Every error is OpenAI's JSON shape, ``{"error": {"message",
"type", "param", "code"}}``: 400 for a bad request (malformed JSON, unknown or unsupported field, a value out of
range, a prompt past the context, a chat request to a model without a template), 404 for an unknown model or
path, 503 when the queue is full, 500 when the engine failed the request.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ModelError
from .chat import TemplateError
from .engine import EngineClosed, GenParams, QueueFull
from .protocol import ChatRequest, CompletionRequest, unsupported

POLL_S = 0.25  # how often a non-streamed request looks whether its client is still there


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


def _describe(errors: list) -> tuple[str, str | None]:
    """pydantic's errors -> one message naming the field (and the first problem), and the field."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    field = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})", None
    if e.get("type") == "extra_forbidden":
        return f"unknown field '{field}'", field
    if e.get("type") == "missing":
        return f"'{field}' is required", field
    where = f"'{field}': " if field else ""
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}{e.get('msg')}, got {json.dumps(e.get('input'), default=str)[:80]}{more}", field


def build_app(engine, tok, model_name: str, chat_template=None, metrics=None) -> FastAPI:
    """The app serving ``engine`` (its model and ``tok``) as ``model_name``."""
    app = FastAPI(title="moqe serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        message, field = _describe(e.errors())
        return _error(400, message, param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        what = {404: f"no such path: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(e.status_code, what.get(e.status_code, str(e.detail)),
                      "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health():
        if not engine._thread.is_alive():
            return _error(503, "the engine has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "moqe-toolkit", "max_model_len": engine.context}]}

    def check_common(body):
        if body.model != model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'",
                           "not_found_error", "model", "model_not_found")
        name = unsupported(body)
        if name:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "'stream_options' is only allowed with stream: true", param="stream_options")

    def params_of(body, max_tokens: int, logprobs, prompt_logprobs=None) -> GenParams:
        V = engine.cfg.vocab_size
        bias = {}
        for k, v in (body.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) < V:
                raise ApiError(400, f"logit_bias: '{k}' is not a token id of this model (0 .. {V - 1})", param="logit_bias")
            bias[int(k)] = float(v)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop: an empty stop string", param="stop")
        ids = list(body.stop_token_ids or [])
        if any(i >= V for i in ids):
            raise ApiError(400, f"stop_token_ids: ids must lie in [0, {V})", param="stop_token_ids")
        p = GenParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else float(body.temperature),
                      top_p=1.0 if body.top_p is None else float(body.top_p), top_k=max(0, body.top_k or 0),
                      seed=body.seed, repetition_penalty=float(body.repetition_penalty),
                      presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
                      logit_bias=bias, stop=tuple(stops), stop_token_ids=tuple(ids), ignore_eos=body.ignore_eos,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs, routing=body.return_routing)
        try:
            p.sampling().validate()
        except ModelError as e:
            raise ApiError(400, str(e)) from None
        return p

    def context_check(prompt: list, max_tokens: int) -> None:
        if len(prompt) + max_tokens > engine.context:
            raise ApiError(400, f"this model's maximum context length is {engine.context} tokens; the request needs "
                                f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} for the "
                                f"completion)", param="max_tokens" if len(prompt) < engine.context else "prompt",
                           code="context_length_exceeded")

    async def run(request: Request, prompts: list, n: int, params: GenParams):
        """Submit every prompt's ``n`` sequences; -> (an asyncio queue of (choice index, Event), their requests)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        reqs = []
        try:
            for i, ids in enumerate(prompts):
                def put(ev, base=i * n):
                    loop.call_soon_threadsafe(q.put_nowait, (base + ev.choice, ev))

                reqs.append(engine.submit(ids, params, n, put))
        except QueueFull as e:
            for r in reqs:
                r.abort()
            raise ApiError(503, str(e), "server_overloaded", code="queue_full") from None
        except EngineClosed as e:
            raise ApiError(503, str(e), "server_error") from None
        except ModelError as e:
            for r in reqs:
                r.abort()
            raise ApiError(400, str(e)) from None
        return q, reqs

    def token_text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    # ---- /v1/completions -------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_common(body)
        prompts, texts = _prompts(body.prompt, tok, engine.cfg.vocab_size)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens 0 returns nothing without echo", param="max_tokens")
        for p in prompts:
            context_check(p, max_tokens)
        params = params_of(body, max_tokens, body.logprobs,
                           body.logprobs if body.echo and body.logprobs is not None else None)
        rid, n = f"cmpl-{uuid.uuid4().hex}", body.n
        q, reqs = await run(request, prompts, n, params)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        states = [_Choice(i, prompts[i // n], texts[i // n]) for i in range(len(prompts) * n)]
        if body.echo:
            for c in states:
                c.text = c.prompt_text
        if body.stream:
            async def events():
                async for i, ev in _drain(q, len(states), reqs):
                    c = states[i]
                    c.add(ev)
                    piece = {"index": i, "text": ev.text, "logprobs": None, "finish_reason": _reason(ev)}
                    if c.first and body.echo:
                        piece["text"] = c.prompt_text + ev.text
                    if body.logprobs is not None:
                        piece["logprobs"] = _completion_logprobs(c, ev, token_text, body.echo and c.first)
                    c.first = False
                    if ev.finish == "error":
                        yield _sse({"error": {"message": ev.error, "type": "server_error", "param": None, "code": None}})
                        continue
                    if ev.finish is not None:
                        _extras(piece, c, ev, body, engine)
                    if piece["text"] or piece["finish_reason"] or piece["logprobs"]:
                        yield _sse({**base, "choices": [piece]})
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(states, n)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)
        await _collect(q, states, reqs, request)
        choices = []
        for c in states:
            d = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": _reason(c.last)}
            if body.logprobs is not None:
                d["logprobs"] = _completion_logprobs(c, None, token_text, body.echo)
            _extras(d, c, c.last, body, engine)
            choices.append(d)
        return {**base, "choices": choices, "usage": _usage(states, n)}

    # ---- /v1/chat/completions --------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_common(body)
        if chat_template is None:
            raise ApiError(400, f"the model '{model_name}' has no chat template (no chat_template.jinja, no "
                                "chat_template in tokenizer_config.json); use /v1/completions", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
        try:
            text = chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
            ids = tok.encode(text, add_bos=False)
        except TemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        except ModelError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        _, _ = _prompts(ids, tok, engine.cfg.vocab_size)  # ids inside the vocabulary
        given = body.max_completion_tokens or body.max_tokens
        max_tokens = given if given is not None else engine.context - len(ids)
        if max_tokens < 1:
            context_check(ids, 1)
        context_check(ids, max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = params_of(body, max_tokens, top)
        rid, n = f"chatcmpl-{uuid.uuid4().hex}", body.n
        q, reqs = await run(request, [ids], n, params)
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        states = [_Choice(i, ids, "") for i in range(n)]
        if body.stream:
            chunk = {**base, "object": "chat.completion.chunk"}

            async def events():
                for c in states:  # the role first, as OpenAI does
                    yield _sse({**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]})
                async for i, ev in _drain(q, n, reqs):
                    c = states[i]
                    c.add(ev)
                    if ev.finish == "error":
                        yield _sse({"error": {"message": ev.error, "type": "server_error", "param": None, "code": None}})
                        continue
                    piece = {"index": i, "delta": {"content": ev.text} if ev.text else {}, "logprobs": None,
                             "finish_reason": _reason(ev)}
                    if body.logprobs and ev.logprobs:
                        piece["logprobs"] = {"content": [_chat_logprob(lp, token_text) for lp in ev.logprobs]}
                    if ev.finish is not None:
                        _extras(piece, c, ev, body, engine)
                    if ev.text or piece["finish_reason"] or piece["logprobs"]:
                        yield _sse({**chunk, "choices": [piece]})
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield _sse({**chunk, "choices": [], "usage": _usage(states, n)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)
        await _collect(q, states, reqs, request)
        choices = []
        for c in states:
            d = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                 "finish_reason": _reason(c.last)}
            if body.logprobs:
                d["logprobs"] = {"content": [_chat_logprob(lp, token_text) for lp in c.logprobs]}
            _extras(d, c, c.last, body, engine)
            choices.append(d)
        return {**base, "choices": choices, "usage": _usage(states, n)}

    return app


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Choice:
    """What one choice produced so far."""

    def __init__(self, index: int, prompt: list, prompt_text: str):
        self.index, self.prompt, self.prompt_text = index, prompt, prompt_text
        self.text, self.tokens, self.logprobs = "", [], []
        self.prompt_logprobs = None
        self.last = None
        self.first = True

    def add(self, ev) -> None:
        self.text += ev.text
        self.tokens += ev.tokens
        self.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finish is not None:
            self.last = ev


def _prompts(prompt, tok, vocab: int) -> tuple[list, list]:
    """A completions ``prompt`` (a string, strings, token ids, lists of ids) -> (token id lists, their texts)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            try:
                one = tok.encode_for(p, vocab, "the prompt")
            except ModelError as e:
                raise ApiError(400, f"prompt: {e}", param="prompt") from None
            texts.append(p)
        else:
            one = list(p)
            if any(t < 0 or t >= vocab for t in one):
                raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
            texts.append(tok.decode(one))
        if not one:
            raise ApiError(400, "prompt: a prompt with no tokens", param="prompt")
        ids.append(one)
    return ids, texts


async def _drain(q: asyncio.Queue, count: int, reqs: list):
    """Events until ``count`` sequences have finished; the requests are aborted if the consumer goes away (a client
    that disconnected cancels the stream)."""
    left = count
    try:
        while left:
            i, ev = await q.get()
            left -= ev.finish is not None
            yield i, ev
    finally:
        for r in reqs:
            r.abort()


async def _collect(q: asyncio.Queue, states: list, reqs: list, request: Request) -> None:
    """Gather every choice of a non-streamed request, aborting it when its client disconnects."""
    left = len(states)
    try:
        while left:
            try:
                i, ev = await asyncio.wait_for(q.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ApiError(499, "client disconnected") from None
                continue
            states[i].add(ev)
            left -= ev.finish is not None
    finally:
        for r in reqs:
            r.abort()
    for c in states:
        if c.last.finish == "error":
            raise ApiError(500, f"the engine failed this request: {c.last.error}", "server_error")


def _reason(ev) -> str | None:
    """OpenAI's finish_reason: "stop" or "length" (or "abort": the request ended before its client read it)."""
    return None if ev is None else ev.finish


def _usage(states: list, n: int) -> dict:
    prompt = sum(len(c.prompt) for c in states[::n])
    done = sum(c.last.completion_tokens if c.last is not None else len(c.tokens) for c in states)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _extras(d: dict, c: _Choice, ev, body, engine) -> None:
    if body.return_token_ids:
        d["token_ids"] = list(c.tokens)
        d["prompt_token_ids"] = list(c.prompt)
    if body.return_routing and ev is not None and ev.routing is not None:
        d["routing"] = {"layers": list(engine.moe_layers), "experts": int(ev.routing.shape[1]),
                        "counts": np.asarray(ev.routing).tolist()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _completion_logprobs(c: _Choice, ev, token_text, echo: bool) -> dict:
    """OpenAI's legacy ``logprobs`` of a completion (or of one streamed event when ``ev`` is given)."""
    lps = list(ev.logprobs) if ev is not None else list(c.logprobs)
    tokens, values, tops = [], [], []
    if echo and c.prompt_logprobs is not None:
        for t, lp in zip(c.prompt, c.prompt_logprobs):
            tokens.append(token_text(t))
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {token_text(a): b for a, b in lp.top})
    for lp in lps:
        tokens.append(token_text(lp.token))
        values.append(lp.logprob)
        tops.append({token_text(a): b for a, b in lp.top})
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprob(lp, token_text) -> dict:
    def one(t, v):
        s = token_text(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(a, b) for a, b in lp.top]}
