"""Speculative decoding is exact: greedy output equals plain decoding token for token (float64),
sampled output has the model's law (a chi-square test that a wrong residual fails), a seed
repeats its text, and bad drafts are refused in one line."""
import json
import math

import numpy as np
import pytest
from helpers import clean_fail, run
from test_generate import randomized

from tbp.generate import speculative
from tbp.generate.sampling import Sampling, generate_ids
from tbp.generate.speculative import Draft, Lookup, Tally, speculative_ids

MODELS = [dict(), dict(positions="rope"), dict(attention="gqa", n_kv_head=1),
          dict(positions="rope", norm="rms", mlp="swiglu", bias=False, tie_head=False, head_bias=False)]
MODEL_IDS = ["learned", "rope", "gqa", "llama-blocks"]


def tokens(gen) -> list[int]:
    return [int(t[0]) for t in gen]


def drafters(dtype, kw):
    """Prompt lookup, another model as the draft, and the model itself (every draft kept)."""
    return {"lookup": lambda m: Lookup(2, 4), "other": lambda m: Draft(randomized(dtype, seed=7, **kw), 3),
            "itself": lambda m: Draft(m, 5)}


@pytest.mark.parametrize("kw", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("prompt_len", [1, 5, 12])
def test_greedy_speculative_decoding_equals_plain_decoding_in_float64(kw, prompt_len):
    model = randomized(np.float64, **kw)
    prompt = list(np.random.default_rng(3).integers(0, 17, prompt_len))
    plain = tokens(generate_ids(model, prompt, 40, Sampling(0.0), np.random.default_rng(0)))   # past n_ctx = 12
    for name, make in drafters(np.float64, kw).items():
        tally = Tally()
        spec = tokens(speculative_ids(model, prompt, 40, Sampling(0.0), np.random.default_rng(0), make(model), tally))
        assert spec == plain, name
        assert tally.tokens == 40 == tally.forwards + tally.accepted       # each forward: its kept drafts and one more
        if name == "itself":                  # the model drafting for itself: every draft is kept
            assert tally.acceptance == 1.0 or tally.drafted == 0
            # a rotary model drafts only within its context (past it, its cache is a ring)
            assert tally.drafted > 0 or kw.get("positions") == "rope" and prompt_len == 12


def test_greedy_speculative_decoding_in_float32_parts_only_at_rounding_ties():
    """One product over k + 1 rows rounds differently from k + 1 one-row products: the two
    greedy outputs may part only where plain decoding's top two logits are within 1e-5 of
    each other (relative to the logits' scale). Counted over 30 prompts."""
    model = randomized(np.float32)
    parted = 0
    for seed in range(30):
        prompt = list(np.random.default_rng(seed).integers(0, 17, 4))
        plain = tokens(generate_ids(model, prompt, 10, Sampling(0.0), np.random.default_rng(0)))
        spec = tokens(speculative_ids(model, prompt, 10, Sampling(0.0), np.random.default_rng(0), Draft(model, 4)))
        if spec == plain:
            continue
        i = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)
        logits = model.forward(np.array([prompt + plain[:i]]))[0, -1].astype(np.float64)
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] <= 1e-5 * np.abs(logits).max(), (seed, i, top2)
        parted += 1
    assert parted <= 3


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=5, top_p=0.9), Sampling(1.2, min_p=0.1)],
                         ids=["t1", "t0.8-k5-p0.9", "t1.2-minp0.1"])
@pytest.mark.parametrize("kw", MODELS, ids=MODEL_IDS)
def test_a_sampled_speculative_text_is_plain_decodings_text_with_the_same_seed(sampling, kw):
    """Each position's token is drawn from the uniform plain decoding draws there: whatever was
    drafted, the same seed gives plain decoding's text (float64)."""
    model = randomized(np.float64, **kw)
    for seed in range(3):
        plain = tokens(generate_ids(model, [1, 2, 3], 30, sampling, np.random.default_rng(seed)))
        for name, make in drafters(np.float64, kw).items():
            assert tokens(speculative_ids(model, [1, 2, 3], 30, sampling, np.random.default_rng(seed), make(model))) \
                == plain, (name, seed)


def test_the_draft_length_follows_acceptance_and_cost():
    """Pace: drafts nothing where drafts are never kept (once its costs are measured), the most
    where every one is, and probes now and then while off."""
    from tbp.generate.speculative import Pace
    pace = Pace(6)
    assert pace.k == 0                                     # nothing measured: a plain step, to measure it
    pace.update(drafted=0, accepted=0, forward_s=1.0e-3, draft_s=0.0)
    assert pace.k == 6                                     # then the most, to measure that
    for _ in range(20):
        pace.update(drafted=3, accepted=0, forward_s=1.2e-3, draft_s=1e-4)
        pace.update(drafted=0, accepted=0, forward_s=1.0e-3, draft_s=0.0)
    pace.steps = 1
    assert pace.k == 0
    for _ in range(20):
        pace.update(drafted=6, accepted=6, forward_s=1.1e-3, draft_s=1e-4)
    assert pace.k == 6


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile at significance 0.001 (z: the normal's 0.999 quantile), by
    Wilson and Hilferty's cube-root approximation (within 1 % for df >= 5)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def law_of_two_tokens(model, prompt, sampling):
    """The model's exact probabilities of every pair of next tokens, (V, V)."""
    from tbp.generate.sampling import probabilities
    V = model.config.vocab_size
    first = probabilities(model.forward(np.array([prompt]))[:, -1], sampling)[0]
    second = probabilities(model.forward(np.array([prompt + [a] for a in range(V)]))[:, -1], sampling)
    return first[:, None] * second


def chi_square(model, make_drafter, prompt, sampling, n=4000) -> tuple[float, float]:
    """(statistic, critical value at 0.001) of n speculative samples of two tokens against the law."""
    V = model.config.vocab_size
    law = law_of_two_tokens(model, prompt, sampling).ravel()
    counts = np.zeros(V * V)
    rng = np.random.default_rng(0)
    drafter = make_drafter()
    for _ in range(n):
        a, b = tokens(speculative_ids(model, prompt, 2, sampling, rng, drafter))
        counts[a * V + b] += 1
    assert counts[law == 0].sum() == 0                  # nothing the law forbids is ever drawn
    cells = law * n >= 5                                 # the test's cells: expected counts of 5 or more
    expected = np.append(law[cells] * n, law[~cells].sum() * n)
    observed = np.append(counts[cells], counts[~cells].sum())
    if expected[-1] == 0:
        expected, observed = expected[:-1], observed[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, chi_square_critical(len(expected) - 1)


CASES = {
    "draft, temperature 1": (Sampling(1.0), lambda: Draft(randomized(np.float64, seed=7, vocab_size=6), 2)),
    "draft, top-k 4, temperature 0.7": (Sampling(0.7, top_k=4), lambda: Draft(randomized(np.float64, seed=7, vocab_size=6), 2)),
    "lookup, temperature 1": (Sampling(1.0), lambda: Lookup(2, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_samples_have_the_models_law(case):
    """The proof of exactness: two tokens sampled speculatively 4,000 times follow the model's
    own law (chi-square at significance 0.001); the prompt makes the lookup draft."""
    sampling, make = CASES[case]
    model = randomized(np.float64, vocab_size=6)
    stat, critical = chi_square(model, make, [1, 2, 3, 1, 2], sampling)
    assert stat < critical, (case, stat, critical)


@pytest.mark.parametrize("case", ["draft, temperature 1", "lookup, temperature 1"])
def test_a_wrong_residual_fails_the_law(case, monkeypatch):
    """A rejected position drawn afresh from p (which can give the rejected draft again) instead
    of from the residual max(0, p - q): the test sees it."""
    fresh = np.random.default_rng(99)
    monkeypatch.setattr(speculative, "residual_token", lambda cdf, d, u: speculative.token_at(cdf, fresh.random()))
    sampling, make = CASES[case]
    model = randomized(np.float64, vocab_size=6)
    stat, critical = chi_square(model, make, [1, 2, 3, 1, 2], sampling)
    assert stat > critical, (case, stat, critical)


def test_lookup_drafts_what_followed_the_last_occurrence_of_the_final_ngram():
    ctx = np.array([5, 1, 2, 9, 8, 7, 1, 2, 4, 6, 1, 2])
    assert Lookup(2, 3).propose(ctx, 3, Sampling(0.0)) == [4, 6, 1]                 # the latest earlier "1 2"
    assert Lookup(3, 3).propose(np.array([3, 1, 2, 7, 0, 1, 2]), 3, Sampling(0.0)) == [7, 0, 1]  # 3-gram absent: 2
    assert Lookup(3, 3).propose(np.array([3, 4, 5, 6]), 3, Sampling(0.0)) == []                   # no match, no draft
    assert Lookup(1, 2).propose(np.array([4, 5, 6, 4]), 2, Sampling(0.0)) == [5, 6]


def test_models_that_cannot_roll_back_their_cache_are_refused():
    mta = randomized(np.float64, attention="mta", mta_cq=2, mta_ck=3)
    with pytest.raises(ValueError):
        list(speculative_ids(mta, [1, 2], 5, Sampling(0.0), np.random.default_rng(0), Lookup()))


# --- the command line ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run, a smaller draft of the same data, one of another context, one of another tokenizer."""
    from conftest import CORPUS
    from helpers import tiny
    d = tmp_path_factory.mktemp("spec")
    corpus = d / "corpus.txt"
    corpus.write_text(CORPUS)
    out = {}
    for name, extra in (("target", tiny(n_layer=2, n_ctx=64)), ("draft", tiny(n_ctx=64)), ("other_ctx", tiny(n_ctx=32)),
                        ("other_tok", [*tiny(n_ctx=64), "--tokenizer", "bpe", "--vocab-size", "300"])):
        r = run(["train", "--data", corpus, "--out", d / name, "--max-iters", 30, *extra])
        assert r.exit_code == 0, r.output
        out[name] = d / name
    return out


def test_generate_lookup_and_draft_print_plain_greedy_text_and_say_what_they_did(runs):
    base = ["generate", "--checkpoint", runs["target"], "--prompt", "the cat sat on the mat. the cat",
            "--max-new-tokens", 60, "--temperature", 0]
    plain = run(base)
    assert plain.exit_code == 0, plain.output
    for extra in (["--lookup"], ["--lookup", "--lookup-ngram", 1, "--draft-tokens", 2], ["--draft", runs["draft"]]):
        r = run([*base, *extra])
        assert r.exit_code == 0, r.output
        assert r.stdout == plain.stdout
        assert "tokens a forward" in r.stderr
    r = run([*base, "--lookup", "--json", "--seed", 1])
    record = json.loads(r.stdout.splitlines()[0])
    assert record["speculation"].startswith("prompt lookup")
    counts = record["speculative"]
    assert counts["target_forwards"] >= 1 and 0 <= counts["accepted"] <= counts["drafted"]


@pytest.mark.parametrize("extra,code,message", [
    (["--lookup", "--num-samples", "2"], 2, "--lookup decodes one sample"),
    (["--lookup", "--no-kv-cache"], 2, "cannot run with --no-kv-cache"),
    (["--lookup-ngram", "2"], 2, "--lookup-ngram sizes speculative decoding"),
    (["--lookup", "--lookup-ngram", "0"], 2, "--lookup-ngram"),
    (["--lookup", "--draft-tokens", "1000"], 2, "--draft-tokens"),
    (["--lookup", "--draft", "x"], 2, "give --lookup or --draft, not both"),
])
def test_bad_speculation_options_are_usage_errors(runs, extra, code, message):
    clean_fail(run(["generate", "--checkpoint", runs["target"], "--prompt", "the", *extra]), code, message)


def test_a_draft_that_cannot_draft_is_refused_naming_both_models(runs):
    for name, message in (("other_ctx", "its context is 32 tokens"), ("other_tok", "their tokenizers differ")):
        r = run(["generate", "--checkpoint", runs["target"], "--prompt", "the", "--draft", runs[name]])
        clean_fail(r, 1, message)
        assert str(runs[name]) in r.output.replace("\n", "") and str(runs["target"]) in r.output.replace("\n", "")
    clean_fail(run(["generate", "--checkpoint", runs["target"], "--prompt", "the", "--draft", runs["target"] / "nope"]),
               1, "no such checkpoint")


def test_bench_times_a_runs_decoding_plain_and_speculative_and_says_what_the_drafts_did(runs):
    base = ["bench", "--checkpoint", runs["target"], "--prompt", "the cat sat on the mat. the cat", "--gen-tokens", 12]
    for extra, name in ((["--lookup"], "prompt lookup"), (["--draft", runs["draft"]], "a draft")):
        r = run([*base, *extra, "--json"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)
        assert res["speculation"].startswith(name) or str(runs["draft"]) in res["speculation"]
        assert res["same_text"] is True                  # greedy: speculation is exact
        assert res["plain_tokens_per_s"] > 0 and res["speculative_tokens_per_s"] > 0
        assert res["target_forwards"] >= 1 and 0 <= res["accepted"] <= res["drafted"]
        assert res["speculation_rounds"] == 5 and res["speculation_tokens"] == 12
    r = run(base)
    assert r.exit_code == 0, r.output
    assert "tokens/s" in r.output and "speculative" not in r.output
    r = run([*base, "--lookup"])
    assert r.exit_code == 0, r.output
    table = " ".join(r.output.replace("│", " ").split())          # the table's cells, unwrapped
    assert "tokens a forward of the model" in table and "the same as plain decoding's" in table


@pytest.mark.parametrize("extra,message", [
    (["--lookup"], "give the run with --checkpoint"),
    (["--prompt", "the"], "--prompt is for --checkpoint"),
    (["--checkpoint", "RUN", "--n-layer", "2"], "--n-layer shapes or trains a configuration"),
    (["--checkpoint", "RUN", "--gen-tokens", "0"], "--gen-tokens 0 leaves nothing to time"),
    (["--checkpoint", "RUN", "--sparse", "window", "--budget", "8"], "is timed on a configuration"),
])
def test_bench_refuses_options_that_a_runs_decoding_would_ignore(runs, extra, message):
    clean_fail(run(["bench", *[str(runs["target"]) if a == "RUN" else a for a in extra]]), 2, message)


def test_serve_decodes_speculatively_the_same_greedy_text_and_reports_it_in_usage(runs):
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from test_serve import Server
    s = Server(runs["target"])
    try:
        body = {"model": "m", "prompt": "the cat sat on the mat. the cat", "max_tokens": 30, "temperature": 0}
        plain = httpx.post(s.url + "/completions", json=body, timeout=60).json()
        assert "usage" in plain, plain
        assert "speculative" not in plain["usage"]
        s.served.drafter = Lookup(3, 8)
        spec = httpx.post(s.url + "/completions", json=body, timeout=60).json()
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        counts = spec["usage"]["speculative"]
        assert counts["target_forwards"] + counts["accepted"] == spec["usage"]["completion_tokens"]
    finally:
        s.stop()


def test_serve_refuses_speculation_with_batched_requests(runs):
    clean_fail(run(["serve", "--checkpoint", runs["target"], "--lookup", "--parallel", 4]), 2,
               "--lookup decodes one request at a time")
