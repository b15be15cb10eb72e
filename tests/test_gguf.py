"""GGUF export, proven against llama.cpp itself (llama-cpp-python): the same logits, the same
tokens, the same greedy text, the same loss -- and refusals for what llama.cpp cannot compute."""
import json

import numpy as np
import pytest
from helpers import clean_fail, run, train_tiny

from tbp import GPT, ModelConfig
from tbp.runs import commit, disk
from tbp.data.tokenizer import CHAT_SPECIALS, train_bpe, train_char

gguf = pytest.importorskip("gguf", reason="the gguf extra is not installed: pip install -e '.[gguf]'")
CFG = dict(n_ctx=96, n_layer=2, n_head=2, d_model=32)
SHAPES = {"learned": {}, "rope": dict(positions="rope", bias=False), "gqa": dict(attention="gqa", n_kv_head=1)}


def llama_cpp():
    """llama-cpp-python: llama.cpp itself, which the tests below run the files in."""
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it compiles llama.cpp): "
                                                   "pip install -e '.[test-all]'")


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["hello world, hello tokenizer; the cat sat on the mat\n" * 40], 300)


def make_run(path, tok, seed=1, **kw):
    model = GPT(ModelConfig.from_dict(dict(vocab_size=tok.vocab_size, **{**CFG, **kw})), seed=seed)
    rng = np.random.default_rng(seed)
    for p in model.params.values():
        p += rng.standard_normal(p.shape).astype(np.float32) * 0.1
    commit.save_plain(path, model, tok, {"model": model.config.to_dict(), "train": None, "lora": None,
                                             "base": None, "data": None})
    return model


def export(run_dir, out, kind="f32", *extra):
    r = run(["export", run_dir, "--format", "gguf", "--type", kind, "--out", out, *extra])
    assert r.exit_code == 0, r.output
    return out


def load(path, n_ctx=96, threads=2, **kw):
    """llama.cpp with a float32 KV cache (its default is f16), every position's logits kept, and
    the weights as the file holds them: on a CPU with AMX, llama.cpp repacks q8_0 matrices for
    its AMX kernels, and that path crashes there -- on llama.cpp's own q8_0 files as well
    (ggml-org/llama.cpp#20824); ``llama-cli --no-repack`` is the same switch. ``kw``: more of
    Llama's arguments (a draft model, say)."""
    lc = llama_cpp()
    default = lc.llama_cpp.llama_model_default_params

    def as_stored():
        params = default()
        params.use_extra_bufts = False
        return params
    lc.llama_cpp.llama_model_default_params = as_stored        # read once, in Llama's constructor
    try:
        return lc.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=threads,
                        n_threads_batch=threads, type_k=0, type_v=0, seed=0, **kw)
    finally:
        lc.llama_cpp.llama_model_default_params = default


def llama_logits(llm, ids) -> np.ndarray:
    llm.reset()
    llm.eval(list(ids))
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


class LlamaGelu:
    """tbp's forward with llama.cpp's CPU GELU: ggml looks the tanh GELU up in a float16 table (its
    input rounded to float16, the value stored as float16; exact 0 below -10 and identity above 10).
    With it the two programs compute the same numbers to float32 rounding; without it they
    differ by that table's rounding alone."""

    def __enter__(self):
        import tbp.nn.mlp as mlp
        self.mlp, self.exact = mlp, mlp.gelu_forward

        def table(u):
            g, s = self.exact(u.astype(np.float16).astype(np.float32))
            g = g.astype(np.float16).astype(np.float32)
            return np.where(u <= -10, 0, np.where(u >= 10, u, g)).astype(u.dtype), s
        mlp.gelu_forward = table

    def __exit__(self, *exc):
        self.mlp.gelu_forward = self.exact


# --- the file, without llama.cpp -------------------------------------------------------------
def test_gpt2_tensors_names_shapes_and_keys(tmp_path, tok):
    make_run(tmp_path / "run", tok)
    out = export(tmp_path / "run", tmp_path / "m.gguf")
    r = gguf.GGUFReader(out)
    names = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in r.tensors}
    C, V = 32, tok.vocab_size
    assert names["token_embd.weight"] == ((C, V), "F32") and names["position_embd.weight"] == ((C, 96), "F32")
    assert names["blk.1.attn_qkv.weight"] == ((C, 3 * C), "F32") and names["blk.1.ffn_down.weight"] == ((4 * C, C), "F32")
    assert "output.weight" not in names                      # tied: llama.cpp reads the embedding
    assert len(names) == 2 + 12 * 2 + 2

    def value(key):
        f = r.fields[key]
        return f.contents()
    assert value("general.architecture") == "gpt2" and value("gpt2.context_length") == 96
    assert value("gpt2.attention.head_count") == 2 and value("gpt2.block_count") == 2
    assert value("tokenizer.ggml.model") == "gpt2" and value("tokenizer.ggml.pre") == "gpt-2"
    assert value("tokenizer.ggml.eos_token_id") == tok.eot_id and value("tokenizer.ggml.add_bos_token") is False
    assert value("tokenizer.ggml.tokens")[:3] == [tok.hf.id_to_token(i) for i in range(3)]


def test_linear_weights_are_transposed_and_missing_biases_are_zeros(tmp_path, tok):
    model = make_run(tmp_path / "run", tok, positions="rope", bias=False)
    r = gguf.GGUFReader(export(tmp_path / "run", tmp_path / "m.gguf"))
    t = {x.name: np.array(x.data) for x in r.tensors}
    np.testing.assert_array_equal(t["blk.0.attn_qkv.weight"], model.params["h.0.attn.c_attn.weight"].T)
    np.testing.assert_array_equal(t["blk.0.ffn_up.bias"], np.zeros(4 * 32, np.float32))
    np.testing.assert_array_equal(t["output.weight"], model.params["wte"])     # gptneox: the head written out
    assert r.fields["general.architecture"].contents() == "gptneox"
    assert r.fields["gptneox.rope.dimension_count"].contents() == 16
    assert r.fields["gptneox.use_parallel_residual"].contents() is False


def test_f16_and_q8_0_keep_norms_and_biases_in_f32(tmp_path, tok):
    make_run(tmp_path / "run", tok)
    for kind, matrix in (("f16", "F16"), ("q8_0", "Q8_0")):
        r = gguf.GGUFReader(export(tmp_path / "run", tmp_path / f"{kind}.gguf", kind))
        types = {t.name: t.tensor_type.name for t in r.tensors}
        assert types["blk.0.attn_qkv.weight"] == matrix and types["token_embd.weight"] == matrix
        assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_qkv.bias"] == "F32"


@pytest.mark.parametrize("kw, why", [
    (dict(attention="mta"), "Multi-Token Attention"),
    (dict(residual="attention"), "Attention Residuals"),
    (dict(activation="relu"), "activation relu"),
    (dict(d_qk=8), "query/key width 8"),
    (dict(tie_head=False), "untied head has a bias"),
])
def test_models_llama_cpp_cannot_compute_are_refused(tmp_path, tok, kw, why):
    make_run(tmp_path / "run", tok, **kw)
    r = run(["export", tmp_path / "run", "--format", "gguf", "--out", tmp_path / "m.gguf"])
    clean_fail(r, 1, "llama.cpp has no architecture that computes this model")
    assert why in r.output and not (tmp_path / "m.gguf").exists()


def test_the_encoder_decoder_is_refused():
    from tbp.interop import gguf as tg
    cfg = ModelConfig.from_dict(dict(vocab_size=8, n_ctx=16, n_layer=1, n_head=2, d_model=16, arch="encoder-decoder", pad_id=7))
    with pytest.raises(Exception, match="encoder-decoder"):
        tg.architecture(cfg)


def test_char_tokenizers_map_exactly_or_are_refused():
    from tbp.interop.gguf import vocabulary
    plain = train_char("ab\\\n\t é")
    v = vocabulary(plain)
    assert v["model"] == "rwkv" and v["eos"] is None                 # no end-of-text: nothing ends generation
    assert "\\n" in v["tokens"] and "\\t" in v["tokens"] and "\\\\" in v["tokens"] and "é" in v["tokens"]
    chat = train_char("ab é\n", specials=CHAT_SPECIALS)
    v = vocabulary(chat)
    assert v["model"] == "gpt2" and v["merges"] == ["Ã ©"]            # é is two bytes: one merge
    assert "Ġ" in v["tokens"] and "Ċ" in v["tokens"] and "<|end|>" in v["tokens"]
    assert v["template"] and v["eot"] == chat.hf.get_vocab()["<|end|>"]
    with pytest.raises(Exception, match="3 bytes in UTF-8"):
        vocabulary(train_char("ab€", specials=CHAT_SPECIALS))


def test_out_is_a_gguf_file_and_force_replaces_only_tbps(tmp_path, tok):
    make_run(tmp_path / "run", tok)
    clean_fail(run(["export", tmp_path / "run", "--format", "gguf", "--out", tmp_path / "m.bin"]), 1, "ending in .gguf")
    export(tmp_path / "run", tmp_path / "m.gguf")
    clean_fail(run(["export", tmp_path / "run", "--format", "gguf", "--out", tmp_path / "m.gguf"]), 1,
               "already exists")
    export(tmp_path / "run", tmp_path / "m.gguf", "f32", "--force")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(64))
    r = run(["export", tmp_path / "run", "--format", "gguf", "--out", other, "--force"])
    clean_fail(r, 1, "is not a GGUF file tbp wrote")
    assert other.read_bytes() == b"GGUF" + bytes(64)
    clean_fail(run(["export", tmp_path / "run", "--type", "q8_0", "--out", tmp_path / "hf"]), 2, "--format gguf")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# --- against llama.cpp -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", list(SHAPES))
def test_llama_cpp_computes_tbps_logits(tmp_path, tok, shape):
    """f32: equal to tbp with llama.cpp's GELU table to 1e-4 of the largest logit (measured
    <= 8e-6 on an AVX-512 Xeon; 6.5e-5 with rotary positions on an AVX2 EPYC, whose rotation
    llama.cpp computes with other kernels), and to tbp's exact GELU within 1e-3 (measured 2-4e-4: the table's rounding);
    f16 within 3e-3 and q8_0 within 5e-2 of the exact logits (measured <= 8e-4 and <= 2e-2)."""
    model = make_run(tmp_path / "run", tok, **SHAPES[shape])
    text = "hello world, the cat sat on the mat; hello tokenizer"
    ids = tok.encode(text)
    exact = model.forward(np.array([ids]))[0].astype(np.float64)
    with LlamaGelu():
        tabled = model.forward(np.array([ids]))[0].astype(np.float64)
    for kind, tol in (("f32", 1e-3), ("f16", 3e-3), ("q8_0", 5e-2)):
        llm = load(export(tmp_path / "run", tmp_path / f"{kind}.gguf", kind))
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
        got = llama_logits(llm, ids)
        assert rel(got, exact) < tol, (kind, rel(got, exact))
        if kind == "f32":
            assert rel(got, tabled) < 1e-4, rel(got, tabled)


def greedy(llm, ids, n):
    llm.reset()
    out, last = [], list(ids)
    for _ in range(n):
        llm.eval(last)
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        last = [t]
    return out


LLAMA_FLAGS = ["--norm", "rms", "--mlp", "swiglu", "--positions", "rope", "--no-bias", "--untie-head", "--no-head-bias"]


@pytest.mark.parametrize("tokenizer,blocks", [("char", []), ("bpe", []), ("bpe", LLAMA_FLAGS)],
                         ids=["char", "bpe", "bpe, Llama blocks"])
def test_trained_model_greedy_text_and_loss_match_llama_cpp(tmp_path, corpus_file, monkeypatch, tokenizer, blocks):
    """A trained run: llama.cpp tokenizes the text as tbp does, its 64 greedy tokens are tbp's,
    and its mean loss over the validation split's windows is tbp eval's (a model of Llama blocks
    as llama.cpp's llama architecture too)."""
    extra = ["--tokenizer", tokenizer] + (["--vocab-size", "300"] if tokenizer == "bpe" else []) + blocks
    run_dir = train_tiny(tmp_path, corpus_file, monkeypatch, "run", 60, "--n-ctx", "80", "--d-model", "32",
                         "--n-layer", "2", *extra)
    out = export(run_dir, tmp_path / "m.gguf")
    llm = load(out, n_ctx=80)
    model, tok, _ = disk.load_model(run_dir)
    prompt = "3 the cat sat on"
    ids = tok.encode(prompt)
    assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids
    g = run(["generate", "--checkpoint", run_dir, "--prompt", prompt, "--max-new-tokens", 64,
             "--temperature", 0, "--seed", 0])
    assert g.exit_code == 0, g.output
    lib = llama_cpp()
    vocab = lib.llama_model_get_vocab(llm.model)
    ending = {t for t in range(tok.vocab_size) if lib.llama_vocab_is_eog(vocab, t)}
    assert ending == ({tok.eot_id} if tokenizer == "bpe" else set())   # a char model: no token ends the text
    mine = greedy(llm, ids, 64)
    assert llm.detokenize(mine).decode() == tok.decode(mine)
    assert (prompt + tok.decode(mine)) in g.output
    # the loss over the validation split, window by window as tbp eval reads it
    e = run(["eval", "--checkpoint", run_dir, "--json"])
    assert e.exit_code == 0, e.output
    figures = json.loads(e.output[e.output.index("{"):e.output.rindex("}") + 1])
    from tbp.data.batches import batches_for
    from tbp.data.datasets import Dataset
    ds = Dataset.load(tmp_path / figures["data"])
    total = count = 0
    for b in batches_for(ds, model.config, model.collation).ordered("val", 8):
        for idx, tgt in zip(b.idx, b.targets):
            z = llama_logits(llm, idx)
            z -= z.max(-1, keepdims=True)
            nll = np.log(np.exp(z).sum(-1)) - z[np.arange(len(tgt)), tgt]
            total += nll.sum()
            count += len(tgt)
    assert count == figures["val_tokens"]
    assert abs(total / count - figures["val_loss"]) < 1e-3 * figures["val_loss"], (total / count, figures)


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_a_chat_model_keeps_its_template_and_tokens_in_llama_cpp(tmp_path, tokenizer):
    """The file's template, rendered by llama-cpp-python and tokenized with reserved tokens
    parsed, gives tbp's prompt tokens; its reply ends at <|end|>. The char tokenizer here has
    reserved tokens, so it is written in byte-level form (é: two bytes, one merge)."""
    from tbp.data import chat
    text = "Be loud. the sky is blue. the snow is white, café?\n" * 30
    tok = train_char(text, specials=CHAT_SPECIALS) if tokenizer == "char" else \
        train_bpe([text], 300, specials=CHAT_SPECIALS)
    make_run(tmp_path / "run", tok)
    out = export(tmp_path / "run", tmp_path / "m.gguf")
    llm = load(out)
    msgs = [{"role": "system", "content": "Be loud."}, {"role": "user", "content": "the café sky?"}]
    r = gguf.GGUFReader(out)
    template = r.fields["tokenizer.chat_template"].contents()
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    prompt = Jinja2ChatFormatter(template, eos_token="<|endoftext|>", bos_token="<|endoftext|>")(messages=msgs).prompt
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == chat.prompt_ids(tok, msgs)
    plain = "the café sky\nis blue"
    assert llm.tokenize(plain.encode(), add_bos=False, special=False) == tok.encode(plain)
    end = chat.template(tok).stop
    lib = llama_cpp()
    vocab = lib.llama_model_get_vocab(llm.model)
    ending = {t for t in range(tok.vocab_size) if lib.llama_vocab_is_eog(vocab, t)}
    assert llm.token_eos() == tok.eot_id and ending == {end, tok.eot_id}      # nothing else ends a reply


# --- a model of Llama blocks: llama.cpp's llama architecture --------------------------------
LLAMA_BLOCKS = dict(norm="rms", mlp="swiglu", positions="rope", bias=False, head_bias=False, attention="gqa",
                    n_kv_head=2, swiglu_hidden=40, rope_base=5000.0)


def test_interleaving_moves_rotate_halfs_pairs_next_to_each_other():
    """Rotating the interleaved rows' adjacent pairs (llama.cpp's llama graph) gives the rotate-half
    rotation (tbp's, Hugging Face's) of the original rows, reordered the same way: the scores,
    dot products of rotated queries and keys, are unchanged."""
    from tbp.interop.gguf import interleave
    rng = np.random.default_rng(0)
    H, D, C, t = 2, 8, 5, 7.0
    w, x = rng.standard_normal((H * D, C)), rng.standard_normal(C)
    theta = t * 10000.0 ** (-np.arange(0, D, 2) / D)
    cos, sin = np.cos(theta), np.sin(theta)
    halves = (w @ x).reshape(H, 2, D // 2)                       # rotate-half: pairs (i, i + D/2)
    rotated = np.stack([halves[:, 0] * cos - halves[:, 1] * sin, halves[:, 1] * cos + halves[:, 0] * sin], 1)
    pairs = (interleave(w, H) @ x).reshape(H, D // 2, 2)         # adjacent pairs (2i, 2i + 1)
    adjacent = np.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], -1)
    np.testing.assert_allclose(adjacent.reshape(H, D), rotated.swapaxes(1, 2).reshape(H, D), rtol=1e-12)
    assert not np.allclose(interleave(w, H), w)


@pytest.mark.parametrize("tie", [False, True], ids=["untied head", "tied head"])
def test_llama_cpp_computes_a_model_of_llama_blocks(tmp_path, tok, tie):
    """RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases: the llama
    architecture, its logits within 1e-4 in f32 (measured 3e-7 on an AVX2 EPYC), 3e-3 in f16
    and 5e-2 in q8_0, and an untied head with a bias, or a layer norm with SwiGLU, refused."""
    model = make_run(tmp_path / "run", tok, **LLAMA_BLOCKS, tie_head=tie)
    text = "hello world, the cat sat on the mat; hello tokenizer"
    ids = tok.encode(text)
    exact = model.forward(np.array([ids]))[0].astype(np.float64)
    for kind, tol in (("f32", 1e-4), ("f16", 3e-3), ("q8_0", 5e-2)):
        path = export(tmp_path / "run", tmp_path / f"{kind}.gguf", kind)
        llm = load(path)
        assert llm.metadata["general.architecture"] == "llama"
        assert rel(llama_logits(llm, ids), exact) < tol, kind
    make_run(tmp_path / "bad", tok, **{**LLAMA_BLOCKS, "bias": True})
    r = run(["export", tmp_path / "bad", "--format", "gguf", "--out", tmp_path / "bad.gguf"])
    clean_fail(r, 1, "a model of Llama blocks exports as llama")


def test_a_smollm_tokenizer_keeps_its_digits_apart_in_llama_cpp_and_others_are_refused(tmp_path):
    """SmolLM2's pre-tokenizer (each digit apart, then GPT-2's) is llama.cpp's "smollm": llama.cpp
    then cuts text as tbp does; a tokenizer llama.cpp would cut otherwise is refused, never written."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from tbp.data.tokenizer import Tokenizer
    from tbp.errors import TbpError
    from tbp.interop import gguf

    def trained(pre):
        t = HFTokenizer(models.BPE())
        t.pre_tokenizer, t.decoder = pre, decoders.ByteLevel()
        t.train_from_iterator(["the year 2026 had 365 days, and 12 months\n" * 50 + "hello world 42\n" * 50],
                              trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return Tokenizer(t)
    tok = trained(pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False)]))
    assert gguf.vocabulary(tok)["pre"] == "smollm"
    model = make_run(tmp_path / "run", tok)
    llm = load(export(tmp_path / "run", tmp_path / "s.gguf"))
    text = "in 2026 there were 365 days and 12 months"
    ids = tok.encode(text)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
    assert rel(llama_logits(llm, ids), model.forward(np.array([ids]))[0].astype(np.float64)) < 1e-3
    other = trained(pre_tokenizers.Sequence([pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel()]))
    with pytest.raises(TbpError, match="llama.cpp would cut text differently"):
        gguf.vocabulary(other)
