"""Log-probabilities: tbp generate --json --logprobs and tbp serve's logprobs fields are the
model's log-softmax at each sampled token (the training forward's, recomputed here), with the
likeliest alternatives in order; speculative decoding reports the model's, never the draft's."""
import json

import numpy as np
import pytest
from helpers import clean_fail, run
from test_speculative import runs  # noqa: F401  (the module's runs)

from tbp.generate.sampling import log_probs
from tbp.runs import disk

PROMPT = "the cat sat on the mat. the cat"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max()
    return z - np.log(np.exp(z).sum())


def test_log_probs_is_the_log_softmax_with_the_likeliest_in_order():
    logits = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    token, lp, top = log_probs(logits, 7, 5)
    want = log_softmax(logits)
    assert token == 7 and lp == pytest.approx(want[7], abs=1e-12)
    assert [i for i, _ in top] == list(np.argsort(-want)[:5])
    assert [x for _, x in top] == pytest.approx(sorted(want, reverse=True)[:5], abs=1e-12)
    assert log_probs(logits, 3, 0)[2] == []


def forward_log_probs(run_dir, prompt_ids, tokens) -> np.ndarray:
    """The training forward's log-probability of each token after the prompt and those before it."""
    model, _, _ = disk.load_model(run_dir)
    ids = np.array([prompt_ids + tokens[:-1]])
    logits = model.forward(ids)[0, len(prompt_ids) - 1:]
    return np.array([log_softmax(row)[t] for row, t in zip(logits, tokens)])


@pytest.mark.parametrize("extra", [[], ["--lookup"], ["--draft", "DRAFT"]], ids=["plain", "lookup", "draft"])
def test_generate_json_logprobs_are_the_models_log_softmax(runs, extra):  # noqa: F811
    extra = [runs["draft"] if e == "DRAFT" else e for e in extra]
    r = run(["generate", "--checkpoint", runs["target"], "--prompt", PROMPT, "--max-new-tokens", 20,
             "--temperature", 0.8, "--seed", 3, "--json", "--logprobs", 3, *extra])
    assert r.exit_code == 0, r.output
    record = json.loads(r.stdout.splitlines()[0])
    _, tok, _ = disk.load_model(runs["target"])
    entries = record["logprobs"]
    assert len(entries) == 20 and "".join(e["token"] for e in entries) == record["completion"]
    vocab = tok.hf.get_vocab()
    tokens = [vocab[e["token"]] for e in entries]
    want = forward_log_probs(runs["target"], tok.encode(PROMPT), tokens)
    np.testing.assert_allclose([e["logprob"] for e in entries], want, atol=2e-4)     # float32's rounding
    for e in entries:
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] >= e["logprob"] - 1e-9


def test_logprobs_need_json(runs):  # noqa: F811
    clean_fail(run(["generate", "--checkpoint", runs["target"], "--prompt", "the", "--logprobs", 2]), 2,
               "give --json with it")


@pytest.fixture(scope="module")
def server(runs):  # noqa: F811
    pytest.importorskip("starlette")
    from test_serve import Server
    s = Server(runs["target"])
    yield s
    s.stop()


def test_serve_completions_logprobs_whole_and_streamed(server, runs):  # noqa: F811
    httpx = pytest.importorskip("httpx")
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.7, "seed": 5, "logprobs": 2}
    whole = httpx.post(server.url + "/completions", json=body, timeout=60).json()
    lp = whole["choices"][0]["logprobs"]
    text = whole["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text and len(lp["token_logprobs"]) == whole["usage"]["completion_tokens"] == 12
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    _, tok, _ = disk.load_model(runs["target"])
    vocab = tok.hf.get_vocab()
    want = forward_log_probs(runs["target"], tok.encode(PROMPT), [vocab[t] for t in lp["tokens"]])
    np.testing.assert_allclose(lp["token_logprobs"], want, atol=2e-4)
    streamed = []
    with httpx.stream("POST", server.url + "/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                    streamed += chunk["choices"][0]["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(streamed, lp["token_logprobs"], atol=1e-12)


def test_serve_logprobs_with_speculation_are_the_models(server):
    httpx = pytest.importorskip("httpx")
    from tbp.generate.speculative import Lookup
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1}
    plain = httpx.post(server.url + "/completions", json=body, timeout=60).json()
    server.served.drafter = Lookup(3, 8)
    try:
        spec = httpx.post(server.url + "/completions", json=body, timeout=60).json()
    finally:
        server.served.drafter = None
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    np.testing.assert_allclose(spec["choices"][0]["logprobs"]["token_logprobs"],
                               plain["choices"][0]["logprobs"]["token_logprobs"], atol=2e-4)


@pytest.mark.parametrize("body,message", [
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"logprobs": True}, "logprobs must be an integer"),
])
def test_serve_refuses_bad_logprobs(server, body, message):
    httpx = pytest.importorskip("httpx")
    r = httpx.post(server.url + "/completions", json={"model": "m", "prompt": "the", **body}, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
