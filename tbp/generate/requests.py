"""What ``tbp serve`` answers, without HTTP: a loaded run, OpenAI's requests read and checked
against it (completions and chat completions), the reply decoded token by token, and the
response bodies shaped as OpenAI's (whole or as stream chunks). server.py puts it behind HTTP.

Text. Prompts and message contents are encoded as text with reserved-token matching off (the
tokenizer's rule), so no request can forge a role, an end of message or an end of text: the
chat template's tokens enter only by id. A chat reply never holds a role token or padding (they
are masked out of sampling, as ``tbp chat`` does); it ends at ``<|end|>`` or ``<|endoftext|>``.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..data import chat as chatfmt
from .batcher import Batcher, Ending
from ..errors import TbpError
from .sampling import Sampling, generate_ids
from .speculative import Tally, speculative_ids
from ..nn import build
from ..nn.decode import Inference
from ..data.tokenizer import Tokenizer

MAX_STOP = 4                     # OpenAI's limit on stop sequences
MAX_LOGPROBS = 20                # OpenAI's limit on top_logprobs
COMPLETION_DEFAULT = 16          # OpenAI's default max_tokens for /v1/completions
# fields a client may send at their neutral value only: anything else would be silently ignored
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False,
           "best_of": (None, 1), "suffix": None, "logit_bias": (None, {}),
           "parallel_tool_calls": None, "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"})}
IGNORED = ("user", "stream_options", "metadata", "store", "service_tier")


class BadRequest(Exception):
    """A request the API refuses: HTTP status, OpenAI's error type and code, the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One checked request: the prompt's ids and how to sample the continuation."""
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ends: tuple[int, ...]                       # tokens that end the reply (finish_reason "stop")
    chat: bool
    logprobs: int | None = None                 # log-probabilities asked for: how many alternatives (None: none)
    tally: object = None                        # speculative decoding's counts, when it decodes this one
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


class Served:
    """A loaded run and the rules for reading requests against it (no HTTP here)."""

    def __init__(self, model, tok: Tokenizer, name: str, drafter=None):
        self.model, self.tok, self.name = model, tok, name
        self.drafter = drafter                  # speculative decoding's (each request gets its own copy)
        self.batcher = None
        self._folds = None                      # folds, once made
        self.n_ctx = model.config.n_ctx
        self.created = int(time.time())
        try:
            self.chat_template = chatfmt.template(tok) if build.refusal(model.config, "chat") is None else None
        except TbpError:
            self.chat_template = None

    # --- reading a request ------------------------------------------------------------------
    def completion(self, body) -> Request:
        body = self._object(body)
        self._fields(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
                            "stream", "logprobs"})
        self._model(body)
        prompt = body.get("prompt", None)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
        ids = self._encode(prompt, "prompt")
        if not ids:
            if self.tok.eot_id is None:
                raise BadRequest("prompt is empty, and this model has no end-of-text token to start from",
                                 "prompt")
            ids = [self.tok.eot_id]
        banned = tuple(i for i in (self.tok.sep_id, self.tok.pad_id) if i is not None)
        ends = tuple(i for i in (self.tok.eot_id,) if i is not None)
        return self._request(body, ids, banned, ends, chat=False, default_max=COMPLETION_DEFAULT)

    def chat(self, body) -> Request:
        body = self._object(body)
        if self.chat_template is None:
            raise BadRequest(f"{self.name} was not trained on conversations (tbp prepare --format chat): "
                             f"use /v1/completions", "messages")
        self._fields(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                            "top_k", "min_p", "stop", "seed", "stream", "logprobs", "top_logprobs"})
        self._model(body)
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty array", "messages")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise BadRequest(f"messages[{i}] must be an object", "messages")
            role = m.get("role")
            role = "system" if role == "developer" else role        # OpenAI's newer name for it
            content = m.get("content")
            if isinstance(content, list):            # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            messages.append({"role": role, "content": content})
        texts = [m["content"] for m in messages if isinstance(m["content"], str)]
        # every message costs its role's opening and its close as well as its text: empty
        # messages by the hundred thousand are refused here, before the template renders them
        tpl = self.chat_template
        per_message = min(len(o) for o in tpl.opens.values()) + len(tpl.close)
        self._bound(sum(self.tok.min_tokens(t) for t in texts) + per_message * len(messages), "messages", chat=True)
        try:
            messages = chatfmt.check_messages(messages, "messages", need_reply=False)
        except TbpError as e:
            raise BadRequest(str(e), "messages") from None
        if messages[-1]["role"] != "user":
            raise BadRequest("the last message must be the user's: the reply is the assistant's", "messages")
        try:
            ids = chatfmt.prompt_ids(self.tok, messages)
        except TbpError as e:
            raise BadRequest(str(e), "messages") from None
        if "max_completion_tokens" in body and "max_tokens" not in body:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        return self._request(body, ids, tpl.banned, (tpl.stop, tpl.eot), chat=True, default_max=None)

    def _object(self, body) -> dict:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def _fields(self, body: dict, known: set) -> None:
        for k, v in body.items():
            if k in known or k in IGNORED:
                continue
            if k in NEUTRAL:
                ok = NEUTRAL[k] if isinstance(NEUTRAL[k], tuple) else (NEUTRAL[k],)
                if v in ok:
                    continue
                raise BadRequest(f"{k} = {json.dumps(v)[:40]} is not supported by tbp serve", k)
            raise BadRequest(f"unrecognized request argument: {k}", k)

    def _model(self, body: dict) -> None:
        """The ``model`` a request names, if it names one, must be this server's."""
        model = body.get("model")
        if model is None or model == self.name:
            return
        if not isinstance(model, str):
            raise BadRequest("model must be a string", "model")
        raise BadRequest(f"The model {json.dumps(model)[:80]} does not exist: this server serves {self.name!r} "
                         f"(GET /v1/models)", "model", status=404, code="model_not_found")

    def _bound(self, at_least: int, param: str, chat: bool = False) -> None:
        """Refuse a prompt that holds at least ``at_least`` tokens (a bound from its length),
        more than the context, before the tokenizer spends memory on all of it."""
        if at_least > self.n_ctx:
            raise BadRequest(f"This model's maximum context length is {self.n_ctx} tokens; the "
                             f"{'messages hold' if chat else 'prompt holds'} at least {at_least:,} tokens",
                             param, code="context_length_exceeded")

    def _encode(self, text: str, param: str) -> list[int]:
        self._bound(self.tok.min_tokens(text), param)
        try:
            return self.tok.encode(text, param)
        except TbpError as e:
            raise BadRequest(str(e), param) from None

    def _request(self, body: dict, ids: list[int], banned: tuple, ends: tuple, chat: bool,
                 default_max: int | None) -> Request:
        def number(key, default, lo, hi, integer=False):
            v = body.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not lo <= v <= hi:
                kind = "an integer" if integer else "a number"
                raise BadRequest(f"{key} must be {kind} in [{lo}, {hi}], got {json.dumps(v)[:40]}", key)
            return v

        temperature = number("temperature", 1.0, 0, 2)
        top_p = number("top_p", 1.0, 0, 1)
        if top_p == 0:
            raise BadRequest("top_p must be above 0", "top_p")
        # llama-server's and vLLM's extensions: top_k 0 (or -1, vLLM's) and min_p 0 turn them off
        top_k = number("top_k", 0, -1, 2 ** 31, integer=True)
        min_p = number("min_p", 0.0, 0, 1)
        seed = number("seed", None, 0, 2 ** 63 - 1, integer=True)
        stop = body.get("stop")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
            raise BadRequest(f"stop must be a string or up to {MAX_STOP} strings", "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream must be true or false", "stream")
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        reads_source = self.model.reads_source
        room = self.n_ctx - 1 if reads_source else self.n_ctx - len(ids)
        if len(ids) > self.n_ctx or room < 1:
            raise BadRequest(f"This model's maximum context length is {self.n_ctx} tokens; the prompt has "
                             f"{len(ids)} tokens, leaving no room for a reply", "messages" if chat else "prompt",
                             code="context_length_exceeded")
        max_tokens = number("max_tokens", None, 1, 2 ** 31, integer=True)
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise BadRequest(f"This model's maximum context length is {self.n_ctx} tokens; the prompt has "
                             f"{len(ids)} tokens and max_tokens asks for {max_tokens} more: ask for at most "
                             f"{room} (the server answers within the context; tbp generate slides past it)",
                             "max_tokens", code="context_length_exceeded")
        sampling = Sampling(temperature=float(temperature), top_k=top_k if top_k > 0 else None,
                            top_p=None if top_p == 1 else float(top_p), banned=banned,
                            min_p=float(min_p) if min_p > 0 else None)
        if chat:        # chat: logprobs true or false, top_logprobs how many alternatives (0 .. 20)
            asked = body.get("logprobs", False)
            if asked is not None and not isinstance(asked, bool):
                raise BadRequest("logprobs must be true or false", "logprobs")
            top = number("top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
            if top is not None and not asked:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            logprobs = (top or 0) if asked else None
        else:           # completions: logprobs is how many alternatives (0 .. 20), null for none
            logprobs = number("logprobs", None, 0, MAX_LOGPROBS, integer=True)
        return Request(ids, max_tokens, sampling, seed, tuple(stop), stream, include_usage, ends, chat, logprobs)

    # --- answering ----------------------------------------------------------------------------
    def decode(self, req: Request, put: Callable[[object], None]) -> Callable[[], None]:
        """Start decoding ``req``: each item -- (text piece, finish reason or None, completion
        tokens), one per sampled token, the last with the finish reason ("stop" or "length") --
        is handed to ``put`` from a decoding thread, or the exception that ended it. With a
        batcher (``batch``) the tokens come from its one step for every request at once;
        otherwise from a thread of this request's own. Returns the function that cancels it (a
        client gone), which takes effect before the next token."""
        if self.batcher is not None:
            return self.batcher.submit(req, put).cancel
        stop = threading.Event()

        def alone():
            try:
                with contextlib.closing(self.alone(req)) as items:
                    for item in items:
                        if stop.is_set():
                            return
                        put(item)
            except Exception as e:                  # the model's error, or a bug: the request hears it
                put(e)
        threading.Thread(target=alone, daemon=True, name="tbp-decode").start()
        return stop.set

    @property
    def folds(self) -> Inference:
        """An Inference of the model whose folded weights every decoder of this server reads
        (``share``: a request's alone, the batcher's): the fold, a copy of nearly every weight,
        is made once -- on the first request, or before serving (``folds.prepare()``), not on
        each. Its own cache is never used."""
        if self._folds is None:
            self._folds = Inference(self.model, 1)
        return self._folds

    def alone(self, req: Request):
        """This request decoded on its own: its items, as ``decode`` hands them out (speculatively
        with the server's drafter, if it has one, counting in ``req.tally``)."""
        rng = np.random.default_rng(req.seed)
        ending = Ending(self.tok, req)
        rows = []                                   # each token's logits, when the request asks for log-probabilities
        keep = (lambda logits, tokens: rows.append(logits[0].copy())) if req.logprobs is not None else None
        if self.drafter is not None:
            req.tally = Tally()
            gen = speculative_ids(self.model, req.ids, req.max_tokens, req.sampling, rng, self.drafter.fresh(),
                                  req.tally, keep, share=self.folds)
        else:
            gen = generate_ids(self.model, req.ids, req.max_tokens, req.sampling, rng, 1, start=self.tok.sep_id,
                               on_logits=keep, share=self.folds)
        try:
            for nxt in gen:
                item = ending.push(int(nxt[0]), rows.pop(0) if rows else None)
                yield item
                if item[1] is not None:
                    return
            # an encoder-decoder's target ran out of positions
            yield ending.stream.flush(), "length", ending.n, None
        finally:
            gen.close()

    def batch(self, slots: int) -> None:
        """Decode up to ``slots`` requests together from now on (Batcher), where the model allows
        sequences at their own positions (no MTA, no encoder-decoder); else they stay one by one."""
        if slots > 1 and self.drafter is not None:
            raise ValueError("speculative decoding serves one request at a time: batched requests share each "
                             "read of the weights already")
        if slots > 1 and build.refusal(self.model.config, "rows") is None:
            self.batcher = Batcher(self.model, self.tok, slots, share=self.folds)

    def models(self) -> dict:
        """OpenAI's list, with what llama-server and vLLM add: the context (``max_model_len``) and
        ``meta`` -- the tokenizer, and how long an answer is when a request does not say (16 tokens
        for a completion, OpenAI's default, which is 16 characters with a char tokenizer)."""
        cfg = self.model.config
        meta = {"tokenizer": self.tok.kind, "n_vocab": cfg.vocab_size, "n_ctx": cfg.n_ctx,
                "n_params": self.model.num_params(),
                "default_max_tokens": {"completions": COMPLETION_DEFAULT, "chat": "the rest of the context"},
                "chat": self.chat_template is not None}
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "tbp", "max_model_len": cfg.n_ctx, "meta": meta}]}

    def chunk(self, req: Request, piece: str | None, finish: str | None, first: bool = False,
              lps: list | None = None, offset: int = 0) -> dict:
        """A stream's chunk: a text piece, and the log-probabilities of the tokens it completes
        (``lps``; ``offset``: the characters sent before it)."""
        logprobs = self.logprobs(req, lps, offset) if lps else None
        if req.chat:
            delta = {} if piece is None else {"content": piece}
            if first:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self._id(req), "object": kind, "created": req.created, "model": self.name,
                "choices": [choice]}

    def whole(self, req: Request, text: str, finish: str, n: int, lps: list | None = None) -> dict:
        logprobs = self.logprobs(req, lps or [], 0) if req.logprobs is not None else None
        if req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        return {"id": self._id(req), "object": kind, "created": req.created, "model": self.name,
                "choices": [choice], "usage": self.usage(req, n)}

    def logprobs(self, req: Request, lps: list, offset: int) -> dict:
        """OpenAI's logprobs object for the tokens ``lps`` ((token, log p, [(id, log p)]) each,
        the model's log-softmax): chat's ``content`` list, or the completions' parallel lists
        (``text_offset`` counts characters from the completion's start, ``offset`` for the first)."""
        text = self.tok.decode
        if req.chat:
            def entry(t, lp):
                s = text([t])
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in top]} for t, lp, top in lps]}
        tokens = [text([t]) for t, _, _ in lps]
        offsets = np.cumsum([offset] + [len(s) for s in tokens[:-1]]).tolist() if tokens else []
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in lps],
                "top_logprobs": [{text([i]): x for i, x in top} for _, _, top in lps], "text_offset": offsets}

    def usage_chunk(self, req: Request, n: int) -> dict:
        """The last chunk of a stream that asked for usage: no choices, the counts."""
        return {**self.chunk(req, None, None), "choices": [], "usage": self.usage(req, n)}

    def usage(self, req: Request, n: int) -> dict:
        """OpenAI's counts; with speculative decoding, what it did (tbp's extension: the model's
        forwards, the drafted and kept tokens, the acceptance rate, tokens a forward)."""
        usage = {"prompt_tokens": len(req.ids), "completion_tokens": n, "total_tokens": len(req.ids) + n}
        if req.tally is not None:
            usage["speculative"] = req.tally.record()
        return usage

    def _id(self, req: Request) -> str:
        return ("chatcmpl-" if req.chat else "cmpl-") + req.id
