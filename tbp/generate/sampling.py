"""Sampling from a model, with a KV cache: a Python generator of token ids, then of text.

Cost. A prefill runs the prompt once (quadratic in its length, like training). After that
each token costs one row of attention against the cache per layer: linear in the number of
tokens so far, never a recomputation of the past (paper §3.2). Without the cache
(``use_cache=False``) every token re-runs the whole window: quadratic per token.

Past the context. With learned positions the cache cannot slide: when it is full, it is
refilled by a prefill of the most recent ``n_ctx // 2`` tokens (one prefill every
``n_ctx / 2`` tokens, so the amortised cost per token stays linear in n_ctx). With rotary
positions it slides: every token attends to the last n_ctx positions, a ring of cache slots
(scores depend only on relative positions) -- sliding-window attention, which is what a
rotary model computes on a sequence longer than its context. The uncached path computes the
same thing by running the training forward over every token the last one depends on. Both
paths see the same context at every step and draw the same random numbers: with the same
seed they produce the same text.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import TbpError
from ..nn.gpt import GPT
from ..nn.decode import Inference
from ..nn import build
from ..data.tokenizer import Tokenizer


@dataclass
class Sampling:
    temperature: float = 1.0       # 0: greedy (argmax)
    top_k: int | None = None       # keep the k most likely tokens (clamped to V)
    top_p: float | None = None     # keep the smallest set whose probability reaches p
    banned: tuple[int, ...] = ()   # tokens never drawn (a completion's <|sep|> and <|pad|>)
    min_p: float | None = None     # keep tokens at least min_p times as likely as the likeliest (llama.cpp's)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min-p must be in [0, 1], got {self.min_p}")


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """Next token for each row of logits (B, V) -> (B,) int64.

    One uniform number per row is drawn (even when greedy), and the token is found by
    inverting the CDF of the filtered distribution: the same draws give the same tokens
    whichever way the logits were computed. Called once per token, so the common case
    (no top-k / top-p) is kept to a handful of NumPy calls.
    """
    u = rng.random(logits.shape[0])                                        # (B,)
    return inverse(cdfs(logits, s), u)


def cdfs(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """What ``inverse`` reads to sample each row of logits (N, V) under ``s``: the rows'
    unnormalised cumulative distributions (N, V) float64, or for greedy decoding the argmax of
    each row (N,) int64. Rows are independent: any rows of a product give each row's own."""
    logits = _checked(logits, s)
    if s.temperature == 0:
        return logits.argmax(-1).astype(np.int64)
    p = _weights(logits, s)
    # ufunc methods and array methods directly: np.cumsum / np.argmax add a Python layer
    return np.add.accumulate(p, axis=-1, out=p)      # unnormalised: compare with u times the total


def inverse(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The token of each row (N,) at its uniform u (N,) in [0, 1): the first whose cumulative
    mass passes u times the total (a zero-probability token never passes first, and u < 1
    guarantees the last one does); greedy rows (``cdf`` of shape (N,)) are their argmax."""
    if cdf.ndim == 1:
        return cdf
    return (cdf > (u * cdf[:, -1])[:, None]).argmax(-1)


def probabilities(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The distribution ``sample`` draws from, (N, V) float64 rows summing to 1: the logits
    (N, V) filtered and tempered as ``s`` says; greedy (temperature 0) is all the mass on the
    first largest logit. Speculative decoding compares these (speculative.py)."""
    logits = _checked(logits, s)
    if s.temperature == 0:
        p = np.zeros(logits.shape, np.float64)
        p[np.arange(len(p)), logits.argmax(-1)] = 1.0
        return p
    p = _weights(logits, s)
    p /= p.sum(-1, keepdims=True)
    return p


def _checked(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The logits, finite (else TbpError), with the banned tokens at -inf (a copy if any)."""
    top = logits.max()                     # NaN if any is, +inf if any is: one pass to tell
    if not np.isfinite(top):
        raise TbpError(f"the model's logits hold {top} at this step: its forward overflows float32 "
                       f"(the weights are damaged or far out of range)")
    if s.banned:
        logits = logits.copy()
        logits[:, list(s.banned)] = -np.inf
    return logits


def _weights(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """Unnormalised probabilities (N, V) float64 after min-p, temperature (> 0), top-k, top-p."""
    z = logits.astype(np.float64)                                          # (B, V), float64 for the CDF
    if s.min_p:
        # p_i >= min_p p_max, on the model's own distribution (before temperature, as llama.cpp's
        # default order has it): a logit at least log(min_p) below the largest is dropped
        z[z < np.maximum.reduce(z, axis=-1, keepdims=True) + np.log(s.min_p)] = -np.inf
    if s.temperature != 1:
        z *= 1.0 / s.temperature
    V = z.shape[-1]
    if s.top_k is not None and s.top_k < V:
        kth = np.partition(z, V - s.top_k, axis=-1)[:, V - s.top_k][:, None]
        z[z < kth] = -np.inf
    z -= np.maximum.reduce(z, axis=-1, keepdims=True)
    p = np.exp(z, out=z)
    if s.top_p is not None and s.top_p < 1:
        p /= p.sum(-1, keepdims=True)
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        # keep a token if the mass before it is below top_p: the first token always stays
        keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < s.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p[~keep] = 0.0
    return p


def log_probs(logits: np.ndarray, token: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """The model's log-probability of ``token`` under logits (V,) -- the log-softmax of the raw
    logits, whatever the sampling settings (OpenAI's logprobs) -- and its ``top`` likeliest
    tokens with theirs, most likely first: (token, log p, [(id, log p), ...]), float64."""
    z = logits.astype(np.float64)
    z -= z.max()
    lp = z - np.log(np.exp(z).sum())
    best = np.argpartition(-lp, top - 1)[:top] if 0 < top < len(lp) else np.arange(len(lp) if top else 0)
    best = best[np.argsort(-lp[best], kind="stable")]
    return int(token), float(lp[token]), [(int(i), float(lp[i])) for i in best]


def generate_ids(model: GPT, prompt: list[int], max_new_tokens: int, sampling: Sampling,
                 rng: np.random.Generator, num_samples: int = 1,
                 use_cache: bool = True, strategy=None, start: int | None = None,
                 on_logits=None, share: Inference | None = None) -> Iterator[np.ndarray]:
    """Yield the next token of every sample, (num_samples,), ``max_new_tokens`` times.
    ``on_logits(logits, tokens)``, if given, is called with each step's logits (num_samples, V)
    and the tokens drawn from them, before they are yielded (the buffer is reused after).

    ``prompt`` must be non-empty and at most n_ctx tokens (the caller crops and warns).
    ``strategy``: how the cached decoder's one-token steps decode beyond dense attention
    (decode.Inference's; a registered decoding strategy), or None.
    An encoder-decoder reads ``prompt`` as its source and starts its target with ``start``
    (the <|sep|> token); its target ends at n_ctx tokens.
    ``share``: an Inference of ``model`` whose folded weights the cached decoder reads instead of
    folding its own (Inference's ``share``: a caller that generates again pays the fold once).
    """
    why = build.refusal(model.config, strategy.use) if strategy is not None else None
    if why is not None:
        raise ValueError(why)
    if model.reads_source:
        yield from _target_ids(model, prompt, max_new_tokens, sampling, rng, num_samples, use_cache, start, on_logits,
                               share)
        return
    if strategy is not None and not use_cache:
        raise ValueError("a decoding strategy decodes from the KV cache: it needs the cache")
    n_ctx = model.config.n_ctx
    if not 1 <= len(prompt) <= n_ctx:
        raise ValueError(f"prompt must have 1..{n_ctx} tokens, got {len(prompt)}")
    slides = model.slides
    # what the uncached path recomputes at each step: the window (learned positions), or with
    # rotary positions every token the last one depends on through L layers of sliding-window
    # attention, L (n_ctx - 1) + 1 of them (further back can reach it through no path)
    reach = model.config.n_layer * (n_ctx - 1) + 1 if slides else n_ctx
    buf = np.empty((num_samples, reach + n_ctx + 1), dtype=np.int64)          # whatever max_new_tokens
    n = len(prompt)                           # tokens in the window
    buf[:, :n] = np.asarray(prompt, dtype=np.int64)
    decoder = Inference(model, num_samples, strategy, share) if use_cache else None
    if decoder is not None:
        logits = decoder.forward(buf[:, :n])[:, -1]                             # (B, V)
    else:
        logits = model.forward(buf[:, :n])[:, -1]
    for _ in range(max_new_tokens):
        nxt = sample(logits, sampling, rng)                                     # (B,)
        if on_logits is not None:
            on_logits(logits, nxt)
        yield nxt
        if n == buf.shape[1]:                 # rotary: keep the tokens that can still matter
            buf[:, :reach] = buf[:, n - reach:n]
            n = reach
        buf[:, n] = nxt
        n += 1
        if slides:                            # the window slides by one token
            if decoder is not None:
                logits = decoder.forward(nxt[:, None], check=False)[:, -1]
            else:
                logits = model.forward(buf[:, max(0, n - reach):n])[:, -1]
            continue
        if n > n_ctx:                         # learned positions, window full: keep the recent half
            keep = n_ctx // 2
            buf[:, :keep] = buf[:, n - keep:n]
            n = keep
            if decoder is not None:
                decoder.reset()
                logits = decoder.forward(buf[:, :n])[:, -1]
                continue
        if decoder is not None:
            logits = decoder.forward(nxt[:, None], check=False)[:, -1]
        else:
            logits = model.forward(buf[:, :n])[:, -1]


def _target_ids(model, source: list[int], max_new_tokens: int, sampling: Sampling,
                rng: np.random.Generator, num_samples: int, use_cache: bool, start: int | None, on_logits=None,
                share: Inference | None = None):
    """An encoder-decoder's target, token by token. Cached: the source is encoded once, each
    layer's cross-attention keys and values computed once (Inference.encode), and every step is
    one row of self-attention against the target's cache. Uncached: the whole model runs on
    the source and the target so far at every step (the baseline; same tokens, same draws)."""
    n_ctx = model.config.n_ctx
    if not 1 <= len(source) <= n_ctx:
        raise ValueError(f"source must have 1..{n_ctx} tokens, got {len(source)}")
    if start is None:
        raise ValueError("an encoder-decoder's target needs a start token (the tokenizer's <|sep|>)")
    src = np.asarray(source, dtype=np.int64)[None, :]
    buf = np.empty((num_samples, n_ctx), dtype=np.int64)            # the target's inputs so far
    buf[:, 0] = start
    n = 1
    if use_cache:
        decoder = Inference(model, num_samples, share=share)
        decoder.encode(src)
        logits = decoder.forward(buf[:, :1])[:, -1]
    else:
        srcs = np.repeat(src, num_samples, axis=0)
        logits = model.forward(srcs, buf[:, :1])[:, -1]
    for _ in range(max_new_tokens):
        nxt = sample(logits, sampling, rng)
        if on_logits is not None:
            on_logits(logits, nxt)
        yield nxt
        if n == n_ctx:                    # no position left to read it back: the target ends
            return
        buf[:, n] = nxt
        n += 1
        if use_cache:
            logits = decoder.forward(nxt[:, None], check=False)[:, -1]
        else:
            logits = model.forward(srcs, buf[:, :n])[:, -1]


class TextStream:
    """Token ids -> text pieces for one sample, safe for streaming.

    Holds back an incomplete multi-byte character (a byte-level BPE token can end inside
    one; the decoder shows it as U+FFFD) and any tail that could still become a stop string.
    """

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tok, tuple(s for s in stop if s)
        self.pending: list[int] = []
        self.text = ""          # everything decoded so far
        self.emitted = 0        # how much of it has been handed out
        self.done = False

    def push(self, token: int) -> str:
        if self.done:
            return ""
        self.pending.append(int(token))
        piece = self.tok.decode(self.pending)
        if piece.endswith("\ufffd") and len(self.pending) < 8:
            return ""           # wait for the rest of the character
        self.pending = []
        self.text += piece
        for s in self.stop:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                self.done = True
                return self._emit(len(self.text))
        hold = max((len(s) - 1 for s in self.stop), default=0)
        return self._emit(max(self.emitted, len(self.text) - hold))

    def flush(self) -> str:
        if self.pending and not self.done:
            self.text += self.tok.decode(self.pending)
            self.pending = []
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cache_bytes: int = 0
    tally: object = None           # speculative decoding's counts (speculative.Tally), if it ran
    logprobs: list | None = None   # each sample's tokens' log-probabilities, when asked for


def generate_text(model: GPT, tok: Tokenizer, prompt: list[int], max_new_tokens: int,
                  sampling: Sampling, rng: np.random.Generator, num_samples: int = 1,
                  use_cache: bool = True, stop: tuple[str, ...] = (),
                  stats: Stats | None = None, strategy=None, drafter=None,
                  logprobs: int | None = None) -> Iterator[tuple[int, str]]:
    """Yield (sample index, text piece) as tokens arrive; a sample ends at a stop string,
    at the tokenizer's end-of-text token, or after ``max_new_tokens``. ``drafter``: decode
    speculatively with it (speculative.py; one sample, the KV cache), counting in ``stats.tally``.
    ``logprobs``: keep each sample's tokens' log-probabilities with that many alternatives
    (log_probs) in ``stats.logprobs``, one list per sample, up to where it ended."""
    stats = stats if stats is not None else Stats()
    rows: list[np.ndarray] = []               # each step's logits, in order, when log-probabilities are kept
    keep = (lambda logits, tokens: rows.append(logits.copy())) if logprobs is not None else None
    stats.logprobs = [[] for _ in range(num_samples)] if logprobs is not None else None
    streams = [TextStream(tok, stop) for _ in range(num_samples)]
    stats.prompt_tokens = len(prompt)
    if use_cache:
        stats.cache_bytes = Inference.cache_size(model, num_samples)
    t0 = time.perf_counter()
    if drafter is not None:
        gen, stats.tally = drafter.decode(model, prompt, max_new_tokens, sampling, rng, keep)
    else:
        gen = generate_ids(model, prompt, max_new_tokens, sampling, rng, num_samples, use_cache, strategy,
                           start=tok.sep_id, on_logits=keep)
    first = True
    for nxt in gen:
        if first:
            stats.prefill_s = time.perf_counter() - t0   # includes the first sampled token
            t0, first = time.perf_counter(), False
        stats.new_tokens += 1
        logits = rows.pop(0) if rows else None
        for i, t in enumerate(nxt):
            s = streams[i]
            if s.done:
                continue
            if logits is not None:
                stats.logprobs[i].append(log_probs(logits[i], int(t), logprobs))
            if tok.eot_id is not None and t == tok.eot_id:
                s.done = True
                continue
            piece = s.push(int(t))
            if piece:
                yield i, piece
        if all(s.done for s in streams):
            break
    stats.decode_s = time.perf_counter() - t0
    for i, s in enumerate(streams):
        piece = s.flush()
        if piece:
            yield i, piece
