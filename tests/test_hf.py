"""Hugging Face GPT-2 export and import: names, shapes, config keys, exact round trips."""
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file
from helpers import run

from tbp import GPT, ModelConfig
from tbp.data.tokenizer import train_bpe

CFG = dict(n_ctx=32, n_layer=2, n_head=2, d_model=16)



@pytest.fixture(scope="module")
def tok():
    return train_bpe(["hello world, hello tokenizer\n" * 40], 300)


def make_run(path, tok, **kw):
    from tbp.runs import commit
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, **{**CFG, **kw}), seed=1)
    rng = np.random.default_rng(0)
    for p in model.params.values():
        p += rng.standard_normal(p.shape).astype(np.float32) * 0.1
    commit.save_plain(path, model, tok, {"model": model.config.to_dict(), "train": None, "lora": None,
                                             "base": None, "data": None})
    return model


def gpt2_names(n_layer):
    names = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    for i in range(n_layer):
        for sub in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                    "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                    "mlp.c_proj.weight", "mlp.c_proj.bias"):
            names.add(f"transformer.h.{i}.{sub}")
    return names


def test_export_writes_gpt2_names_shapes_dtypes_and_config(tmp_path, tok):
    make_run(tmp_path / "run", tok)
    r = run(["export", tmp_path / "run", "--format", "hf", "--out", tmp_path / "hf"])
    assert r.exit_code == 0, r.output
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
        shapes = {k: f.get_tensor(k).shape for k in names}
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert names == gpt2_names(2)
    C = 16
    V = tok.vocab_size
    assert shapes["transformer.wte.weight"] == (V, C) and shapes["transformer.wpe.weight"] == (32, C)
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (C, 3 * C)       # Conv1D: (in, out)
    assert shapes["transformer.h.1.mlp.c_proj.weight"] == (4 * C, C)
    assert dtypes == {np.dtype(np.float32)}
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"], cfg["vocab_size"]) == (16, 2, 2, 32, V)
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is True
    assert cfg["layer_norm_epsilon"] == 1e-5 and cfg["eos_token_id"] == tok.eot_id
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == tok.to_str()


def test_export_import_round_trip_gives_identical_logits(tmp_path, tok):
    model = make_run(tmp_path / "run", tok)
    assert run(["export", tmp_path / "run", "--out", tmp_path / "hf"]).exit_code == 0
    r = run(["import", tmp_path / "hf", "--out", tmp_path / "back"])
    assert r.exit_code == 0, r.output
    back = GPT.load(tmp_path / "back")
    idx = np.random.default_rng(3).integers(0, tok.vocab_size, (2, 32))
    np.testing.assert_array_equal(back.forward(idx), model.forward(idx))
    g = run(["generate", "--checkpoint", tmp_path / "back", "--prompt", "hello", "--max-new-tokens", 5])
    assert g.exit_code == 0, g.output


def test_import_a_hand_built_gpt2_folder(tmp_path, tok):
    """Old-style names (no prefix), causal-mask buffers, a tied lm_head copy, float16 weights."""
    model = make_run(tmp_path / "run", tok)
    d = tmp_path / "gpt2"
    d.mkdir()
    arrays = {}
    for k, v in model.params.items():
        arrays[(k + ".weight") if k in ("wte", "wpe") else k] = v.astype(np.float16)
    for i in range(2):
        arrays[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), dtype=np.float16))
    arrays["lm_head.weight"] = arrays["wte.weight"]
    save_file(arrays, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2,
                                               "n_positions": 32, "vocab_size": tok.vocab_size,
                                               "activation_function": "gelu_new"}))
    tok.save(d / "tokenizer.json")
    r = run(["import", d, "--out", tmp_path / "imp"])
    assert r.exit_code == 0, r.output
    imp = GPT.load(tmp_path / "imp")
    idx = np.random.default_rng(4).integers(0, tok.vocab_size, (1, 20))
    ref = GPT(model.config, seed=0)
    for k in ref.params:
        ref.params[k][...] = model.params[k].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(imp.forward(idx), ref.forward(idx))


@pytest.mark.parametrize("kw,msg", [(dict(activation="relu"), "activation = relu"),
                                    (dict(d_qk=4), "query/key width 4 != value width 8"),
                                    (dict(tie_head=False), "tie_head = False"),
                                    (dict(bias=False), "bias = False")])
def test_export_refuses_what_gpt2_cannot_represent(tmp_path, tok, kw, msg):
    make_run(tmp_path / "run", tok, **kw)
    r = run(["export", tmp_path / "run", "--out", tmp_path / "hf"])
    assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output
    assert not (tmp_path / "hf").exists()


def test_import_refusals(tmp_path, tok):
    make_run(tmp_path / "run", tok)
    assert run(["export", tmp_path / "run", "--out", tmp_path / "hf"]).exit_code == 0
    (tmp_path / "empty").mkdir()
    r = run(["import", tmp_path / "empty", "--out", tmp_path / "x"])
    assert r.exit_code == 1 and "missing config.json" in r.output
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    r = run(["import", tmp_path / "hf", "--out", tmp_path / "x"])
    assert r.exit_code == 1 and "model_type is 'bert'; tbp imports gpt2 and llama folders" in r.output
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "n_embd": 32, "n_head": 2}))
    r = run(["import", tmp_path / "hf", "--out", tmp_path / "x"])
    assert r.exit_code == 1 and "has shape" in r.output and "config.json implies" in r.output
    assert not (tmp_path / "x").exists()


def _folder_from(tmp_path, tok, change):
    """A GPT-2 folder from a tbp run, its tensors changed by ``change(arrays)``."""
    make_run(tmp_path / "run", tok)
    assert run(["export", tmp_path / "run", "--out", tmp_path / "hf"]).exit_code == 0
    from safetensors.numpy import load_file
    arrays = load_file(str(tmp_path / "hf" / "model.safetensors"))
    change(arrays)
    save_file(arrays, str(tmp_path / "hf" / "model.safetensors"))
    return tmp_path / "hf"


NAME = "transformer.h.0.ln_1.weight"


@pytest.mark.parametrize("change, msg", [
    (lambda a: a.update({NAME: np.ones(16, np.int32)}), f"{NAME} is int32"),
    (lambda a: a.update({NAME: np.ones(16, bool)}), f"{NAME} is bool"),
    (lambda a: a.update({NAME: np.ones(16, np.float64)}), f"{NAME} is float64"),
    (lambda a: a.update({NAME[len("transformer."):]: a[NAME] + 1}), "are both GPT-2's"),
])
def test_an_import_never_coerces_a_dtype_or_picks_between_duplicates(tmp_path, tok, change, msg):
    src = _folder_from(tmp_path, tok, change)
    r = run(["import", src, "--out", tmp_path / "x"])
    assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_an_import_names_what_is_not_a_file(tmp_path, tok, kind):
    import os
    src = _folder_from(tmp_path, tok, lambda a: None)
    weights = src / "model.safetensors"
    weights.unlink()
    if kind == "fifo":
        os.mkfifo(weights)
    elif kind == "device":
        weights.symlink_to("/dev/zero")
    else:
        weights.mkdir()
    r = run(["import", src, "--out", tmp_path / "x"])
    said = {"fifo": "a FIFO, not a file", "device": "a character device, not a file", "folder": "a folder"}[kind]
    assert r.exit_code == 1 and said in r.output and "missing" not in r.output, r.output
