"""Multi-turn generation: a conversation with a model, its KV cache kept across turns.

Each turn feeds only the new tokens -- the user's message and the ``<|assistant|>`` that asks
for a reply -- to the same Inference, so the history is never encoded twice. A reply ends at
<|end|> (or <|endoftext|>, or ``max_reply`` tokens, where tbp closes it). When the next turn
would not fit the context with room for a reply, the cache is refilled from the system
message and the most recent whole messages that fit: the oldest turns are forgotten first,
the instruction never.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..data.chat import render, template
from ..errors import TbpError
from .sampling import Sampling, TextStream, sample
from .speculative import Tally, step
from ..nn import build
from ..nn.decode import Inference


class Conversation:
    """A conversation with ``model`` (a GPT trained on a chat dataset) under ``tok``'s template.

    ``reply(text)`` yields the reply to a user message in pieces as it is sampled; afterwards
    ``messages`` holds both. ``refills`` counts how often the context filled up.
    """

    def __init__(self, model, tok, system: str | None = None, sampling: Sampling | None = None,
                 rng: np.random.Generator | None = None, max_reply: int = 256, drafter=None):
        why = build.refusal(model.config, "chat")
        if why is not None:
            raise TbpError(why)
        self.model, self.tok = model, tok
        self.tpl = template(tok)
        self.n_ctx = model.config.n_ctx
        self.max_reply = max(1, min(max_reply, self.n_ctx // 2))
        base = sampling or Sampling()
        # a reply never holds what opens a message or pads: those are the template's
        self.sampling = Sampling(base.temperature, base.top_k, base.top_p, self.tpl.banned, base.min_p)
        self.rng = rng or np.random.default_rng()
        self.decoder = Inference(model, 1)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.system_tokens = len(render(self.tok, self.messages, "all", where="--system")[0])
        # the least a turn adds: a user's opening, one token, the close, an assistant's opening
        self.turn_tokens = len(self.tpl.opens["user"]) + len(self.tpl.close) + len(self.tpl.opens["assistant"])
        if self.system_tokens + self.turn_tokens + 1 > self.n_ctx - self.max_reply:
            raise TbpError((f"the system message's {self.system_tokens} tokens leave" if system else
                            "there is") + f" no room for a message and a reply in this model's context of "
                           f"{self.n_ctx}")
        self.cached: list[int] = []             # the tokens the cache holds, in order
        self.pending: list[int] = []            # the last reply's close, fed with the next turn
        self.refills = 0
        self.drafter = drafter                  # speculative decoding's (speculative.py), or None
        self.tally = Tally()                    # what it did, over the whole conversation

    def _feed(self, ids: list[int]) -> np.ndarray | None:
        """Feed ``ids``; the logits after them. Speculating, the last one is held back for the
        first step to feed (None returned): the step checks its drafts in the same forward."""
        if self.drafter is not None:
            self.held, ids = ids[-1], ids[:-1]
            if not ids:
                return None
        logits = self.decoder.forward(np.array([ids], dtype=np.int64))[0, -1]
        self.cached += ids
        return logits

    def _refill(self) -> np.ndarray:
        """Re-prefill from the system message and the most recent whole messages that fit,
        asking for the reply to the last user message."""
        system = [m for m in self.messages[:1] if m["role"] == "system"]
        turns = self.messages[len(system):]
        budget = self.n_ctx - self.max_reply
        for start in range(0, len(turns), 2):                       # drop the oldest user-reply pairs
            ids = render(self.tok, system + turns[start:], "all")[0].tolist() + list(self.tpl.opens["assistant"])
            if len(ids) <= budget:
                break
        else:
            raise TbpError(f"the message does not fit the context ({self.n_ctx} tokens) with room for a reply")
        self.refills += 1
        self.decoder.reset()
        self.cached, self.pending = [], []
        return self._feed(ids)

    def reply(self, text: str, where: str = "message") -> Iterator[str]:
        """The reply to user message ``text``, in pieces. A message that cannot be taken (a
        character a char tokenizer lacks, one too long for the context) raises TbpError naming
        ``where`` before anything changes: the conversation goes on as it was."""
        room = self.n_ctx - self.max_reply - self.system_tokens - self.turn_tokens
        if self.tok.min_tokens(text) > room:                  # refused before the library spends memory on it
            raise TbpError(f"{where}: at least {self.tok.min_tokens(text)} tokens; with the system message and "
                           f"room for a {self.max_reply}-token reply it does not fit this model's context of "
                           f"{self.n_ctx}")
        body = self.tok.encode(text, where)
        alone = self.system_tokens + len(body) + self.turn_tokens      # user's opening, body, close, assistant's
        if alone > self.n_ctx - self.max_reply:
            raise TbpError(f"{where}: {len(body)} tokens; with the system message and room for a "
                           f"{self.max_reply}-token reply it does not fit this model's context of {self.n_ctx}")
        self.messages.append({"role": "user", "content": text})
        first = not self.cached
        head = render(self.tok, self.messages[:-1], "all")[0].tolist() if first else self.pending
        new = head + [*self.tpl.opens["user"], *body, *self.tpl.close, *self.tpl.opens["assistant"]]
        if len(self.cached) + len(new) + self.max_reply > self.n_ctx:
            logits = self._refill()
        else:
            logits = self._feed(new)
        if self.drafter is not None:
            yield from self._speculate()
            return
        stream, got = TextStream(self.tok), []
        while True:
            nxt = int(sample(logits[None, :], self.sampling, self.rng)[0])
            if nxt in (self.tpl.stop, self.tpl.eot) or len(got) == self.max_reply \
                    or len(self.cached) == self.n_ctx:
                break
            got.append(nxt)
            piece = stream.push(nxt)
            if piece:
                yield piece
            logits = self._feed([nxt])
        piece = stream.flush()
        if piece:
            yield piece
        self._close(got)

    def _close(self, got: list[int]) -> None:
        self.pending = list(self.tpl.close)
        self.messages.append({"role": "assistant", "content": self.tok.decode(got)})

    def _speculate(self) -> Iterator[str]:
        """The reply decoded speculatively: each step drafts, checks and keeps tokens as the plain
        loop would sample them (ending at the same tokens, the cache left holding the same ones:
        drafts kept past the end are rolled back)."""
        stream, got, last = TextStream(self.tok), [], self.held
        self.drafter.start()
        while True:
            ctx = np.array(self.cached + [last], dtype=np.int64)
            k = min(self.drafter.pace.k, self.n_ctx - len(ctx), self.max_reply - len(got) - 1)
            out = step(self.decoder, ctx, max(k, 0), self.drafter, self.sampling, self.rng, self.tally)
            self.cached.append(last)
            for i, t in enumerate(out):
                if t in (self.tpl.stop, self.tpl.eot) or len(got) == self.max_reply or len(self.cached) == self.n_ctx:
                    if self.decoder.length > len(self.cached):
                        self.decoder.rewind(len(self.cached))     # drafts kept past the end
                    piece = stream.flush()
                    if piece:
                        yield piece
                    self._close(got)
                    return
                got.append(t)
                piece = stream.push(t)
                if piece:
                    yield piece
                if i < len(out) - 1:
                    self.cached.append(t)                          # a kept draft: in the cache already
                else:
                    last = t
