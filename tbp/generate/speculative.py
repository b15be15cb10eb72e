"""Speculative decoding: tokens drafted cheaply, checked by one forward of the model, exact.
[Leviathan, Kalman & Matias 2023, "Fast inference from transformers via speculative decoding";
Chen et al. 2023, "Accelerating large language model decoding with speculative sampling"]

Why it pays. At batch 1 a decoding step reads every weight to make one token: its time is the
weights' bytes over the memory bandwidth. A forward over k + 1 tokens reads them once too, and
costs little more. So a drafter proposes k tokens d_1 .. d_k after the context, and one forward
of the model over [last, d_1 .. d_k] (the KV cache holds the rest) gives the model's
distributions p_0 .. p_k at every drafted position at once.

The rule that keeps the model's distribution. A drafter here proposes one token per position,
a point mass q = 1{d}: prompt lookup's copy, or a draft model's most likely token. For a
point mass the rule of Leviathan et al. -- accept d with probability min(1, p(d)/q(d)), else
draw from the residual max(0, p - q), normalised; after k acceptances a bonus token from p_k --
reads: keep d with probability p(d), else draw from p without d, renormalised. Both halves come
from one uniform u, the one plain decoding draws for this position (sampling.sample): the token
x = F^-1(u) of p's inverse CDF is d with probability p(d), and given x != d it is distributed
as p without d, renormalised -- exactly the residual. So the step keeps d iff x == d and emits
x otherwise, and

    P(x) = p(d) 1{x = d} + (1 - p(d)) p(x) 1{x != d} / (1 - p(d)) = p(x),

and more: each position's token is the one plain decoding draws from the same uniform. With the
same seed the text IS plain decoding's, at every temperature and filter (top-k, top-p, min-p act
on p as in sampling), whatever was drafted -- up to the rounding in which a (k + 1)-row product
differs from one-row ones (float32: a token can differ where two logits, or a uniform and a CDF
step, tie to the last bits). That is what frees the draft length to follow measured time
(:class:`Pace`) without changing a single token.

After the step the caches are rolled back past the rejected drafts (Inference.rewind), and the
context window moves exactly as plain decoding moves it (sampling.generate_ids): drafts never
run past the context, a learned-positions window that fills is refilled from its recent half,
and a rotary model past its context decodes one token at a time (its cache is a ring, which
cannot be rolled back).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..nn import build
from ..nn.decode import Inference
from .sampling import Sampling, cdfs, inverse


@dataclass
class Tally:
    """What speculation did: target forwards, tokens drafted and kept, tokens made."""
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None

    def summary(self) -> str:
        """One phrase for a command's stats line."""
        kept = f"{self.acceptance:.0%} of {self.drafted} drafted tokens kept" if self.drafted else "nothing drafted"
        return f"{kept}, {self.tokens_per_forward or 0:.2f} tokens a forward"

    def record(self) -> dict:
        return {"target_forwards": self.forwards, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "tokens_per_forward": self.tokens_per_forward}


def token_at(cdf: np.ndarray, u: float) -> int:
    """Plain decoding's token at uniform u: ``cdf`` is one row of sampling.cdfs (or a greedy
    row's argmax)."""
    return int(inverse(cdf[None], np.array([u]))[0])


def keeps(cdf: np.ndarray, d: int, u: float) -> bool:
    """The acceptance test: the draft d is kept iff it is plain decoding's token at u, which
    happens with probability p(d) = min(1, p(d)/q(d)) for the point mass q on d."""
    return token_at(cdf, u) == d


def residual_token(cdf: np.ndarray, d: int, u: float) -> int:
    """The token a rejected position emits, for the same u the test rejected: plain decoding's,
    which given the rejection is not d and is distributed as the residual max(0, p - q) (module
    docstring)."""
    return token_at(cdf, u)


class Pace:
    """How many tokens to draft next: the k of 0 .. ``most`` with the most expected tokens a
    second. A step with k drafts makes E(k) = (1 - a^(k+1)) / (1 - a) tokens, for a per-token
    acceptance a (Leviathan et al., eq. 1), and costs c(k + 1) + k c_d: the forward over k + 1
    rows and the drafting, both measured as they run (first a plain step, then the most drafts;
    a k never measured is assumed to cost what the next smaller measured one did, so that it is
    tried). So where drafts are rarely
    kept, or checking them costs more than they save (a small model, bound by overheads rather
    than by reading its weights), k falls to 0 and decoding is plain; one step in ``probe``
    drafts anyway, so that a text that starts to copy turns it back on. The text never depends
    on k (module docstring)."""

    probe = 16

    def __init__(self, most: int):
        self.most = most
        self.start()

    def start(self) -> None:
        """A new text: what was learned of this model's costs stays, the acceptance starts afresh."""
        self.kept, self.tried = 1.0, 2.0          # a prior of one kept draft in two
        self.steps = 0
        if not hasattr(self, "cost"):
            self.cost: dict[int, float] = {}      # rows checked -> seconds of the forward (moving average)
            self.draft_cost = 0.0                 # seconds of drafting a token (moving average)

    @property
    def k(self) -> int:
        if 1 not in self.cost:                     # a plain step first: what drafting must beat, measured
            return 0
        if len(self.cost) == 1:                    # then the most, measured too
            return self.most
        a = min(self.kept / self.tried, 0.999)
        best, rate = 0, 0.0
        for k in range(self.most + 1):
            r = (1 - a ** (k + 1)) / (1 - a) / (self._cost(k + 1) + k * self.draft_cost)
            if r > rate:
                best, rate = k, r
        if best == 0 and self.steps % self.probe == 0:
            return min(2, self.most)
        return best

    def _cost(self, rows: int) -> float:
        """The measured seconds of a forward over ``rows`` rows, or of the nearest measured size
        below it (else above it)."""
        below = [m for m in self.cost if m <= rows]
        return self.cost[max(below)] if below else self.cost[min(self.cost)]

    def update(self, drafted: int, accepted: int, forward_s: float, draft_s: float) -> None:
        self.steps += 1
        rows = drafted + 1
        old = self.cost.get(rows)
        self.cost[rows] = forward_s if old is None else 0.8 * old + 0.2 * forward_s
        if drafted:
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * draft_s / drafted if self.draft_cost else draft_s / drafted
            # the acceptance: kept over tried, older steps fading
            self.kept = 0.9 * self.kept + accepted
            self.tried = 0.9 * self.tried + drafted


class Drafter:
    """What a drafter shares: its :class:`Pace`, and ``decode``, a text decoded speculatively
    with it. Each drafter proposes (``propose(ctx, k, sampling)``: up to k tokens after the
    context ctx), follows the target's roll-backs (``rolled_back(kept)``) and restarts
    (``reset``), and makes a copy of itself for a text decoded beside (``fresh``)."""

    pace: Pace

    def start(self) -> None:
        """A new text: the cache empty, the acceptance learned afresh (the costs stay)."""
        self.reset()
        self.pace.start()

    def decode(self, model, prompt: list[int], max_new_tokens: int, sampling: Sampling, rng: np.random.Generator,
               on_logits=None):
        """(the generator of speculative_ids, the Tally it counts in)."""
        tally = Tally()
        return speculative_ids(model, prompt, max_new_tokens, sampling, rng, self, tally, on_logits), tally

    def rolled_back(self, kept: int) -> None:
        pass

    def reset(self) -> None:
        pass


class Lookup(Drafter):
    """Prompt-lookup drafts: find the latest earlier occurrence in the context of its last
    ``ngram`` tokens (else of its last ngram - 1, ..., down to 2, or 1 when ngram is 1) and
    propose the tokens that followed it. No match, no draft: the step is a plain one."""

    name = "lookup"

    def __init__(self, ngram: int = 3, most: int = 8):
        if ngram < 1 or most < 1:
            raise ValueError(f"lookup needs ngram >= 1 and draft tokens >= 1, got {ngram} and {most}")
        self.ngram, self.pace = ngram, Pace(most)

    def describe(self) -> str:
        return f"prompt lookup (n-gram {self.ngram}, up to {self.pace.most} tokens)"

    def fresh(self) -> "Lookup":
        """Another drafter like this one, for a text decoded beside this one's (a server's thread)."""
        return Lookup(self.ngram, self.pace.most)

    def propose(self, ctx: np.ndarray, k: int, sampling: Sampling) -> list[int]:
        n = len(ctx)
        for g in range(min(self.ngram, n - 1), min(2, self.ngram) - 1, -1):
            tail = ctx[n - g:]
            # windows starting at 0 .. n - g - 1: every earlier occurrence, never the tail itself
            starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ctx[:n - 1], g) == tail, axis=1))
            if len(starts):
                i = int(starts[-1]) + g
                return [int(t) for t in ctx[i:i + k]]
        return []


class Draft(Drafter):
    """A draft model's proposals: a smaller model with the same tokenizer decodes k tokens with
    its own KV cache, each its most likely (banned tokens excluded), and is rolled back with the
    target. It must share the target's vocabulary and context."""

    name = "draft"

    def __init__(self, model, most: int = 4, label: str = "a draft model", share: Inference | None = None):
        if most < 1:
            raise ValueError(f"a draft needs draft tokens >= 1, got {most}")
        self.model, self.label, self.pace = model, label, Pace(most)
        self.decoder = Inference(model, 1, share=share)
        self.fed = 0                      # the context's first ``fed`` tokens are in the draft's cache

    def describe(self) -> str:
        cfg = self.model.config
        return f"{self.label} ({cfg.n_layer} × {cfg.d_model}, up to {self.pace.most} tokens)"

    def fresh(self) -> "Draft":
        """Another drafter of the same model with a cache of its own, for a text decoded beside
        this one's (a server's thread), reading this one's folded weights."""
        return Draft(self.model, self.pace.most, self.label, share=self.decoder)

    def propose(self, ctx: np.ndarray, k: int, sampling: Sampling) -> list[int]:
        greedy = Sampling(0.0, banned=sampling.banned)
        logits = self.decoder.forward(ctx[None, self.fed:], check=False)[0, -1:]
        self.fed = len(ctx)
        drafts = []
        for i in range(k):
            drafts.append(int(cdfs(logits, greedy)[0]))
            if i < k - 1:
                logits = self.decoder.forward(np.array([[drafts[-1]]], dtype=np.int64), check=False)[0, -1:]
        return drafts

    def rolled_back(self, kept: int) -> None:
        """The context now holds its old tokens and the first ``kept`` drafts (then the model's
        token): keep what the draft's cache holds of that."""
        length = min(self.decoder.length, self.fed + kept)
        self.decoder.rewind(length)
        self.fed = length

    def reset(self) -> None:
        self.decoder.reset()
        self.fed = 0


def check_draft(target, draft, target_name: str, draft_name: str) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (one line naming both), or None."""
    t, d = target.config, draft.config
    if t.vocab_size != d.vocab_size:
        return (f"{draft_name} cannot draft for {target_name}: its vocabulary has {d.vocab_size} tokens, "
                f"the target's {t.vocab_size}")
    if t.n_ctx != d.n_ctx:
        return f"{draft_name} cannot draft for {target_name}: its context is {d.n_ctx} tokens, the target's {t.n_ctx}"
    why = refusal(d)
    return f"{draft_name} cannot draft: {why}" if why else None


def refusal(cfg) -> str | None:
    """Why a model cannot be decoded speculatively (it reads a source, or its cache cannot be
    rolled back), or None: what its designs declare."""
    return build.refusal(cfg, "speculate")


def step(target: Inference, ctx: np.ndarray, k: int, drafter, sampling: Sampling, rng: np.random.Generator,
         tally: Tally, on_logits=None) -> list[int]:
    """One speculative step. ``target``'s cache holds ``ctx`` but its last token; the drafter
    proposes up to ``k`` tokens after ctx, one forward of [ctx[-1], drafts] checks them, and
    the step returns the kept drafts and the model's own next token, drawing one uniform per
    token returned, as plain decoding draws them (module docstring). The cache then holds ctx
    and the kept drafts; the returned last token is not in it. ``on_logits(logits (1, V),
    token)`` hears the model's logits of each returned token, never a draft's."""
    t0 = time.perf_counter()
    drafts = drafter.propose(ctx, k, sampling) if k > 0 else []
    t1 = time.perf_counter()
    length = target.length
    logits = target.forward(np.asarray([[ctx[-1], *drafts]], dtype=np.int64), check=False)[0]
    cdf = cdfs(logits, sampling)                                          # (k + 1, V), or (k + 1,) greedy
    t2 = time.perf_counter()
    out = []
    for i, d in enumerate(drafts):
        u = rng.random()
        if keeps(cdf[i], d, u):
            out.append(d)
            continue
        out.append(residual_token(cdf[i], d, u))
        break
    else:
        out.append(token_at(cdf[len(drafts)], rng.random()))              # all kept: the bonus token
    kept = len(out) - 1
    if on_logits is not None:
        for i, t in enumerate(out):
            on_logits(logits[i:i + 1], np.array([t]))
    if kept < len(drafts):
        target.rewind(length + 1 + kept)
    drafter.rolled_back(kept)
    drafter.pace.update(len(drafts), kept, t2 - t1, t1 - t0)
    tally.forwards += 1
    tally.drafted += len(drafts)
    tally.accepted += kept
    tally.tokens += len(out)
    return out


def speculative_ids(model, prompt: list[int], max_new_tokens: int, sampling: Sampling, rng: np.random.Generator,
                    drafter, tally: Tally | None = None, on_logits=None, share: Inference | None = None):
    """Yield the next token, (1,) like generate_ids' one sample, ``max_new_tokens`` times:
    drafted by ``drafter`` (Lookup or Draft) and checked by ``model`` (module docstring), the
    context window moved as generate_ids moves it. ``share``: as generate_ids'."""
    why = refusal(model.config)
    if why is not None:
        raise ValueError(why)
    tally = tally if tally is not None else Tally()
    n_ctx, slides = model.config.n_ctx, model.slides
    if not 1 <= len(prompt) <= n_ctx:
        raise ValueError(f"prompt must have 1..{n_ctx} tokens, got {len(prompt)}")
    target = Inference(model, 1, share=share)
    drafter.start()
    ctx = np.asarray(prompt, dtype=np.int64)       # the window; its last token is not yet in the cache
    if len(ctx) > 1:
        target.forward(ctx[None, :-1], check=False)
    made = 0
    while made < max_new_tokens:
        # drafts never pass the context, nor the tokens still wanted (the step adds one more)
        k = min(drafter.pace.k, max(0, n_ctx - len(ctx)), max_new_tokens - made - 1)
        out = step(target, ctx, k, drafter, sampling, rng, tally, on_logits)
        for t in out:
            made += 1
            yield np.array([t], dtype=np.int64)
        ctx = np.concatenate([ctx, np.asarray(out, dtype=np.int64)])
        if len(ctx) > n_ctx:
            if slides:                     # the ring slides one token a step: keep the window
                ctx = ctx[-n_ctx:]
                continue
            keep = n_ctx // 2              # learned positions: refilled from the recent half, as plain decoding
            ctx = ctx[-keep:]
            target.reset()
            drafter.reset()
            if keep > 1:
                target.forward(ctx[None, :-1], check=False)
