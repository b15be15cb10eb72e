"""Several requests decoded together: tbp serve's batcher.

A request (tbp.generate.requests.Request: its prompt ids, sampling settings, seed, stop strings, end
tokens, max_tokens) becomes a :class:`Job` in a slot of one batched Inference; one thread steps
every active job at once (Inference.step_rows, each row at its own position) and hands each its
items -- (text piece, finish reason or None, tokens so far) -- to the job's ``put``, a callable
the caller gives (the server's mailbox: the items reach its event loop without a thread waiting
on each). :class:`Ending` turns a request's tokens into those items, for the batcher and for a
request decoded alone.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import numpy as np

from ..errors import TbpError
from .sampling import TextStream, log_probs, sample
from ..data.tokenizer import Tokenizer
from ..nn.decode import Inference


class Ending:
    """One request's tokens -> (text piece, finish reason or None, tokens so far): the end at an
    end token, a stop string or max_tokens."""

    def __init__(self, tok: Tokenizer, req):
        self.req, self.stream, self.n = req, TextStream(tok, req.stop), 0

    def push(self, t: int, logits: np.ndarray | None = None) -> tuple[str, str | None, int, tuple | None]:
        """The item of token t: (text piece, finish reason or None, tokens so far, its
        log-probabilities from ``logits`` (V,) when the request asks for them, else None)."""
        self.n += 1
        lp = log_probs(logits, t, self.req.logprobs) if self.req.logprobs is not None and logits is not None else None
        if t in self.req.ends:
            return self.stream.flush(), "stop", self.n, lp
        piece = self.stream.push(t)
        if self.stream.done:
            return piece, "stop", self.n, lp
        if self.n == self.req.max_tokens:
            return piece + self.stream.flush(), "length", self.n, lp
        return piece, None, self.n, lp


class Job:
    """A request inside the Batcher: its slot, sampler, where its next token goes, and ``put``,
    which takes each of its items (and an exception, if decoding fails) from the batcher's thread."""

    def __init__(self, tok: Tokenizer, req, put: Callable[[object], None]):
        self.req, self.ending = req, Ending(tok, req)
        self.rng = np.random.default_rng(req.seed)
        self.put = put
        self.slot = self.position = self.last = None
        self.cancelled = self.done = False

    def advance(self, logits: np.ndarray) -> None:
        """Sample the next token from this request's logits (V,) with its own generator."""
        try:
            t = int(sample(logits[None], self.req.sampling, self.rng)[0])
        except TbpError as e:
            self.finish(e)
            return
        item = self.ending.push(t, logits)
        self.put(item)
        self.last = t
        if item[1] is not None:
            self.done = True

    def finish(self, error: Exception) -> None:
        self.put(error)
        self.done = True

    def cancel(self) -> None:
        """Stop decoding this request (its client left): its slot is freed before the next step."""
        self.cancelled = True


class Batcher:
    """Decodes every admitted request together: one thread, one batched Inference of ``slots``
    sequences, each at its own position (Inference.step_rows). A new request is prefilled alone
    (one batched forward of its prompt) and its cache copied into a free slot; then every step
    feeds each active request its last token and samples each one's next token with its own
    generator and settings. Eight streams cost about one step of eight rows instead of eight
    steps of one. The logits equal each request's own to float rounding (the products run over
    several rows), so a sampled token can differ from the request made alone only where two
    tokens' probabilities tie to the last bits."""

    def __init__(self, model, tok: Tokenizer, slots: int, share: Inference | None = None):
        self.tok, self.slots = tok, slots
        self.decoder = Inference(model, slots, share=share)
        self.prefill = Inference(model, 1, share=self.decoder)       # one copy of the folded weights
        self.incoming: queue.Queue = queue.Queue()
        self.active: dict[int, Job] = {}
        threading.Thread(target=self._run, daemon=True, name="tbp-batcher").start()

    def submit(self, req, put: Callable[[object], None]) -> Job:
        """Decode ``req`` among the others, each of its items handed to ``put`` from the
        batcher's thread; the returned job's ``cancel`` stops it."""
        job = Job(self.tok, req, put)
        self.incoming.put(job)
        return job

    def _run(self) -> None:
        while True:
            try:
                self._once()
            except Exception as e:           # a bug: every waiting request hears of it, the server goes on
                for job in list(self.active.values()):
                    job.finish(e)
                self.active.clear()

    def _once(self) -> None:
        free = [s for s in range(self.slots) if s not in self.active]
        while free:
            try:
                job = self.incoming.get(block=not self.active)
            except queue.Empty:
                break
            if job.cancelled:
                continue
            self._start(job, free.pop(0))
        for slot, job in list(self.active.items()):
            if job.done or job.cancelled:
                del self.active[slot]
        if not self.active:
            return
        idx = np.zeros(self.slots, np.int64)
        pos = np.zeros(self.slots, np.int64)          # a free slot decodes a dummy token at 0: overwritten later
        for slot, job in self.active.items():
            idx[slot], pos[slot] = job.last, job.position
        logits = self.decoder.step_rows(idx, pos)
        for slot, job in self.active.items():
            job.position += 1
            job.advance(logits[slot])

    def _start(self, job: Job, slot: int) -> None:
        ids = job.req.ids
        self.prefill.reset()
        logits = self.prefill.forward(np.asarray([ids], dtype=np.int64))[0, -1]
        self.decoder.load_row(slot, self.prefill)
        job.slot, job.position = slot, len(ids)
        job.advance(logits)
        if not job.done:
            self.active[slot] = job
