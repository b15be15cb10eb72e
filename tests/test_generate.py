"""KV-cache decoding equals full recomputation; sampling rules; streaming text."""
import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.nn.lora import LORA_TARGETS, add_lora
from tbp.nn.decode import Inference
from tbp.generate.sampling import Sampling, TextStream, generate_ids, generate_text, sample
from tbp.data.tokenizer import train_bpe, train_char

CFG = dict(vocab_size=17, n_ctx=12, n_layer=2, n_head=2, d_model=16)


def randomized(dtype, seed=0, **kw):
    model = GPT(ModelConfig.from_dict(dict(**{**CFG, **kw})), seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    for p in model.params.values():          # O(1) weights: sharp, varied attention patterns
        p += (rng.standard_normal(p.shape) * 0.3).astype(dtype)
    return model


OPTIONS = [dict(), dict(tie_head=False, d_qk=3), dict(activation="relu", bias=False, ln_eps=0.0)]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("prompt_len", [1, 5, 12])
@pytest.mark.parametrize("options", OPTIONS, ids=["gpt2", "untied-dqk3", "relu-nobias-eps0"])
def test_cached_logits_equal_full_forward_at_every_step(dtype, tol, prompt_len, options):
    model = randomized(dtype, **options)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 17, (2, 12))
    decoder = Inference(model, 2)
    cached = decoder.forward(tokens[:, :prompt_len])                             # prefill
    full = model.forward(tokens[:, :prompt_len])
    np.testing.assert_allclose(cached, full, rtol=0, atol=tol)
    for t in range(prompt_len, 12):                                              # one token at a time
        step = decoder.forward(tokens[:, t:t + 1])[:, -1]
        np.testing.assert_allclose(step, model.forward(tokens[:, :t + 1])[:, -1], rtol=0, atol=tol)
    assert decoder.length == 12
    with pytest.raises(ValueError, match="longer than the context"):
        decoder.forward(tokens[:, :1])
    decoder.reset()                                          # the same buffers serve a new start
    np.testing.assert_allclose(decoder.forward(tokens[:, :3]), model.forward(tokens[:, :3]), rtol=0, atol=tol)


def test_rewinding_the_cache_continues_as_if_the_later_tokens_were_never_fed():
    model = randomized(np.float64)
    rng = np.random.default_rng(6)
    tokens, other = rng.integers(0, 17, (2, 10)), rng.integers(0, 17, (2, 4))
    decoder = Inference(model, 2)
    decoder.forward(tokens[:, :6])
    decoder.forward(other)                                  # a continuation to forget
    decoder.rewind(6)
    for t in range(6, 10):
        np.testing.assert_allclose(decoder.forward(tokens[:, t:t + 1])[:, -1], model.forward(tokens[:, :t + 1])[:, -1],
                                   rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="can rewind to 0 .. 10 cached positions, not 11"):
        decoder.rewind(11)
    mta = randomized(np.float64, attention="mta", mta_cq=2, mta_ck=3)
    dec = Inference(mta, 1)
    dec.forward(tokens[:1, :5])
    with pytest.raises(ValueError, match="Multi-Token Attention's cache keeps only the last rows"):
        dec.rewind(3)
    dec.rewind(5)                                           # to where it is, or to the start: nothing is read back
    dec.rewind(0)
    rope = randomized(np.float64, positions="rope")          # a sliding cache past its context is a ring
    ring = Inference(rope, 1)
    ring.forward(rng.integers(0, 17, (1, rope.config.n_ctx)))
    ring.forward(tokens[:1, :1])
    with pytest.raises(ValueError, match="slid past its context"):
        ring.rewind(3)
    ring.rewind(0)


def test_a_prefill_in_chunks_equals_one_pass(monkeypatch):
    model = randomized(np.float64)
    tokens = np.random.default_rng(5).integers(0, 17, (3, 11))
    whole = Inference(model, 3).forward(tokens).copy()
    monkeypatch.setattr(Inference, "max_scores", 3 * 2 * 12 * 4)     # 4 query rows per chunk
    np.testing.assert_allclose(Inference(model, 3).forward(tokens), whole, rtol=0, atol=1e-12)
    np.testing.assert_allclose(whole, model.forward(tokens), rtol=0, atol=1e-10)


@pytest.mark.parametrize("options", [dict(), dict(mlp="swiglu"), dict(mlp="relu2", tie_head=False, positions="rope"),
                                     dict(attention="mta", mta_cq=2, mta_ck=3)],
                         ids=["gpt2", "swiglu", "relu2-untied-rope", "mta"])
def test_a_decoder_reads_anothers_folded_weights_and_keeps_its_own_cache(options):
    model = randomized(np.float64, **options)
    tokens = np.random.default_rng(8).integers(0, 17, (2, 9))
    lender = Inference(model, 2)
    lender.forward(tokens[:, :4])                           # its cache holds another text
    sharer = Inference(model, 1, share=lender)              # another batch: the folds do not depend on it
    pairs = [(state, lent) for mine, theirs in zip(sharer.layers, lender.layers)
             for (*_, state), (*_, lent) in zip(mine, theirs)]
    assert pairs and all(state.folded is lent.folded for state, lent in pairs)
    assert sharer.head is lender.head
    np.testing.assert_allclose(sharer.forward(tokens[:1, 2:9]), model.forward(tokens[:1, 2:9]), rtol=0, atol=1e-10)
    np.testing.assert_allclose(lender.forward(tokens[:, 4:5])[:, -1], model.forward(tokens[:, :5])[:, -1],
                               rtol=0, atol=1e-10)             # the lender's cache was never written by the other
    with pytest.raises(ValueError, match="same model"):
        Inference(randomized(np.float64, seed=1, **options), 1, share=lender)


def test_decoder_merges_lora_adapters():
    model = randomized(np.float64, tie_head=False)
    add_lora(model, rank=2, alpha=4.0, targets=LORA_TARGETS)
    for name, p in model.params.items():
        if name.endswith("lora_up"):
            p += np.random.default_rng(3).standard_normal(p.shape)     # adapters that change the output
    tokens = np.random.default_rng(4).integers(0, 17, (1, 9))
    np.testing.assert_allclose(Inference(model).forward(tokens), model.forward(tokens), rtol=0, atol=1e-10)


def test_decoder_refuses_wrong_batch_and_non_causal_models():
    model = randomized(np.float32)
    with pytest.raises(ValueError, match="holds 2 sequences, got 1"):
        Inference(model, 2).forward(np.zeros((1, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="causal"):
        Inference(GPT(ModelConfig.from_dict(dict(**CFG, causal=False))))


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0), Sampling(0.7, top_k=5),
                                      Sampling(1.3, top_p=0.8), Sampling(1.0, top_k=4, top_p=0.9)])
@pytest.mark.parametrize("prompt_len", [1, 4, 12])
def test_cache_and_no_cache_produce_identical_tokens(sampling, prompt_len):
    model = randomized(np.float64)
    prompt = list(np.random.default_rng(2).integers(0, 17, prompt_len))
    runs = []
    for use_cache in (True, False):
        gen = generate_ids(model, prompt, 40, sampling, np.random.default_rng(9), num_samples=3,
                           use_cache=use_cache)                     # 40 tokens: well past n_ctx = 12
        runs.append(np.stack(list(gen)))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].shape == (40, 3)


def test_seeded_sampling_is_repeatable_and_seeds_differ():
    model = randomized(np.float32)
    draw = lambda seed: np.stack(list(generate_ids(model, [1, 2], 30, Sampling(1.0), np.random.default_rng(seed))))
    np.testing.assert_array_equal(draw(5), draw(5))
    assert not np.array_equal(draw(5), draw(6))


def test_greedy_is_argmax_and_top_k_1_is_greedy(rng):
    logits = rng.standard_normal((4, 9))
    greedy = logits.argmax(-1)
    np.testing.assert_array_equal(sample(logits, Sampling(0.0), rng), greedy)
    np.testing.assert_array_equal(sample(logits, Sampling(1.0, top_k=1), rng), greedy)
    np.testing.assert_array_equal(sample(logits, Sampling(1.0, top_p=1e-9), rng), greedy)


def test_top_k_is_clamped_and_top_k_and_top_p_restrict_support(rng):
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    seen_k = {int(sample(logits, Sampling(1.0, top_k=2), rng)[0]) for _ in range(300)}
    assert seen_k == {0, 1}
    seen_p = {int(sample(logits, Sampling(1.0, top_p=0.75), rng)[0]) for _ in range(300)}
    assert seen_p == {0, 1}                   # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: two tokens
    seen_all = {int(sample(logits, Sampling(1.0, top_k=100), rng)[0]) for _ in range(2000)}
    assert seen_all == {0, 1, 2, 3}


def test_min_p_keeps_the_tokens_at_least_p_times_as_likely_as_the_likeliest_before_temperature(rng):
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(sample(logits, Sampling(1.0, min_p=0.3), rng)[0]) for _ in range(400)}
    assert seen == {0, 1, 2}                  # 0.15 >= 0.3 x 0.5; 0.05 is not
    hot = {int(sample(logits, Sampling(5.0, min_p=0.3), rng)[0]) for _ in range(400)}
    assert hot == {0, 1, 2}                   # a high temperature flattens what is kept, keeps nothing more
    p = np.array([0.5, 0.3, 0.15])
    draws = np.array([sample(logits, Sampling(1.0, min_p=0.3), rng)[0] for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, p / p.sum(), atol=0.03)


def test_sampling_frequencies_follow_the_distribution(rng):
    p = np.array([0.6, 0.3, 0.1])
    draws = np.array([sample(np.log(p)[None], Sampling(1.0), rng)[0] for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, p, atol=0.03)


@pytest.mark.parametrize("kw,match", [(dict(temperature=-0.1), "temperature"), (dict(top_k=0), "top-k"),
                                      (dict(top_p=0.0), "top-p"), (dict(top_p=1.5), "top-p"),
                                      (dict(min_p=1.5), "min-p"), (dict(min_p=-0.1), "min-p")])
def test_bad_sampling_values(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)


def test_text_stream_never_splits_a_multibyte_character():
    tok = train_bpe(["plain ascii text only\n" * 50], 300)
    ids = tok.encode("é🎉日")             # byte tokens: each character spans several
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == "é🎉日"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_strings_end_a_sample_and_are_not_printed():
    tok = train_char("abcdef\n")
    stream = TextStream(tok, stop=("cd",))
    out = "".join(stream.push(i) for i in tok.encode("abcdefab")) + stream.flush()
    assert out == "ab" and stream.done


def test_generate_text_stops_at_end_of_text():
    tok = train_bpe(["some text\n" * 20], 260)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_ctx=8, n_layer=1, n_head=1, d_model=8,
                            tie_head=False), seed=0)
    model.params["lm_head.bias"][tok.eot_id] += 50.0     # <|endoftext|> is the certain next token
    pieces = list(generate_text(model, tok, [tok.eot_id], 20, Sampling(0.0), np.random.default_rng(0)))
    assert pieces == []


def test_cache_size_matches_what_the_decoder_allocates():
    model = GPT(ModelConfig.from_dict(dict(**CFG, d_qk=3)), seed=0)
    # L * B * n_ctx * H * (Dk + Dv + 1) float32 numbers: 2 * 3 * 12 * 2 * (3 + 8 + 1) * 4 bytes
    assert Inference.cache_size(model, 3) == Inference(model, 3).cache_bytes == 6912


@pytest.mark.parametrize("kw", [dict(), dict(positions="rope"), dict(attention="gqa", n_kv_head=1),
                                dict(residual="attention"), dict(tie_head=False)],
                         ids=["learned", "rope", "gqa", "attnres", "untied"])
def test_sequences_at_their_own_positions_decode_together_as_alone(kw):
    """Inference.step_rows: three prompts of different lengths, prefilled alone and loaded into
    one batched decoder, then stepped together: each row's logits are its own decoder's."""
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    model = GPT(ModelConfig.from_dict(dict(vocab_size=30, n_ctx=32, n_layer=2, n_head=2, d_model=16, **kw)), seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 30, n).tolist() for n in (3, 7, 1)]
    together, one = Inference(model, 3), Inference(model, 1)
    alone = [Inference(model, 1) for _ in prompts]
    for b, p in enumerate(prompts):
        one.reset()
        one.forward(np.array([p]))
        together.load_row(b, one)
        alone[b].forward(np.array([p]))
    pos = np.array([len(p) for p in prompts])
    for tokens in rng.integers(0, 30, (5, 3)):
        got = together.step_rows(tokens, pos).copy()
        for b in range(3):
            want = alone[b].forward(np.array([[tokens[b]]]))[0, -1]
            np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        pos += 1


def test_rows_at_their_own_positions_are_refused_where_they_cannot_be():
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    mta = GPT(ModelConfig(vocab_size=30, n_ctx=16, n_layer=1, n_head=2, d_model=16, attention="mta"), seed=0)
    with pytest.raises(ValueError, match="one at a time"):
        Inference(mta, 2).step_rows(np.zeros(2), np.zeros(2))
    model = GPT(ModelConfig(vocab_size=30, n_ctx=16, n_layer=1, n_head=2, d_model=16), seed=0)
    with pytest.raises(ValueError, match="positions must be in 0 .. 15"):
        Inference(model, 2).step_rows(np.zeros(2), np.array([3, 16]))
