"""QK-norm (tbp/nn/designs/qknorm), the design whose two options prove that a design with
options of its own is its folder and one registration line: the layer against its plain twin
under both kernels, a wrong backward caught, the bound on the scores, its options as flags,
in tbp info and in a run's config.json. The checks every declaration passes (cached decoding
equals the forward, gradient rows) are tests/test_designs.py's and tests/test_gradcheck.py's."""
import json

import numpy as np
import pytest
from helpers import assert_equals_twin, clean_fail, run, train_tiny

from tbp.nn.config import ConfigError, ModelConfig
from tbp.nn.designs.qknorm import qknorm as design
from tbp.nn.designs.qknorm import twin
from tbp.nn.gpt import GPT

B, T, C, H = 2, 7, 12, 3


def randomize(module, rng, scale=0.5):
    for p in module.params.values():
        p[...] = rng.standard_normal(p.shape) * scale


def _against_twin(rng, **options):
    layer = design.QKNormAttention(C, H, 4, C // H, rng, np.float64, **options)
    randomize(layer, rng)
    x, dy = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    layer.zero_grad()
    y = layer.forward(x)
    dx = layer.backward(dy.copy())
    P = layer.params
    y_ref, cache = twin.qknorm_attention_forward(x, P["c_attn.weight"], P["c_attn.bias"], P["c_proj.weight"],
                                                 P["c_proj.bias"], H, 4, options.get("eps", 1e-6),
                                                 options.get("scale"))
    return layer, y, dx, y_ref, twin.qknorm_attention_backward(dy, cache)


@pytest.mark.parametrize("options", [{}, {"eps": 0.1, "scale": 2.0}, {"impl": "flash", "tiles": (2, 3)},
                                     {"eps": 0.5, "impl": "flash", "tiles": (3, 2), "split_rows": 2}], ids=str)
def test_the_layer_equals_its_plain_twin_forward_and_backward(rng, options):
    layer, y, dx, y_ref, grads = _against_twin(rng, **options)
    assert_equals_twin(layer, y, dx, y_ref, *grads)


def test_a_backward_without_the_norms_own_term_differs_from_the_twin(rng, monkeypatch):
    """The twin has teeth: dropping -y mean(dy y) from the norm's backward is caught."""
    monkeypatch.setattr(design, "rms_rows_backward", lambda dy, y, r: r * dy)
    layer, y, dx, y_ref, grads = _against_twin(rng, eps=0.1)
    np.testing.assert_allclose(y, y_ref, rtol=1e-11)              # the forward is untouched
    with pytest.raises(AssertionError):
        assert_equals_twin(layer, y, dx, y_ref, *grads)


def test_the_scores_are_bounded_whatever_the_weights_grow_to(rng):
    """|rms(q) . rms(k)| <= Dk, so every score is within scale * Dk: the weights times 1000
    leave the attention weights where they were (the norm divides the scale out)."""
    layer = design.QKNormAttention(C, H, 4, C // H, rng, np.float64, eps=0.0)
    layer.params["c_attn.bias"][...] = 0
    x = rng.standard_normal((1, T, C))
    layer.forward(x)
    before = layer.weights().copy()
    layer.params["c_attn.weight"][:, :2 * H * 4] *= 1000.0          # queries and keys only
    layer.forward(x)
    np.testing.assert_allclose(layer.weights(), before, rtol=1e-9, atol=1e-12)
    qs, k = layer.cache[0], layer.cache[1]
    assert np.abs(qs @ k.swapaxes(-1, -2)).max() <= layer.scale * 4 * (1 + 1e-12)


def test_its_options_are_its_own_and_a_run_keeps_them_under_its_key():
    cfg = ModelConfig(vocab_size=11, attention="qknorm", designs={"qknorm": {"eps": 0.01, "scale": 0.5}})
    assert cfg.designs["qknorm"] == design.QKNormOptions(eps=0.01, scale=0.5)
    assert cfg.to_dict()["designs"] == {"qknorm": {"eps": 0.01, "scale": 0.5}}
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict({"vocab_size": 11, "attention": "qknorm", "qk_norm_eps": 0.01,
                                  "qk_norm_scale": 0.5}) == cfg            # the flags' flat names
    with pytest.raises(ConfigError, match="qk_norm_eps is a QK-norm option"):
        ModelConfig(designs={"qknorm": {"eps": 0.01}})
    with pytest.raises(ConfigError, match="qk_norm_scale must be >= 0.0"):
        ModelConfig(attention="qknorm", designs={"qknorm": {"scale": -1.0}})
    with pytest.warns(FutureWarning, match=r"designs=\{'qknorm': \{'eps': 0.01\}\}"):
        old = ModelConfig(vocab_size=11, attention="qknorm", qk_norm_eps=0.01)
    assert old.designs["qknorm"].eps == 0.01
    model = GPT(cfg, seed=0, dtype=np.float64)
    assert all(b.attn.positions.eps == 0.01 and b.attn.scale == 0.5 for b in model.blocks)


def test_a_run_with_its_flags_trains_saves_them_and_says_them(tmp_path, corpus_file, monkeypatch):
    r = run(["train", "--help"])
    assert "--qk-norm-eps" in r.output and "--qk-norm-scale" in r.output and "qknorm:" in r.output
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "qk", 4, "--attention", "qknorm", "--qk-norm-eps", "0.001")
    saved = json.loads((out / "config.json").read_text())["model"]
    assert saved["attention"] == "qknorm" and saved["designs"]["qknorm"] == {"eps": 0.001, "scale": 0.0}
    info = run(["info", out])
    assert info.exit_code == 0 and "qk-norm" in info.output and "eps 0.001" in info.output
    clean_fail(run(["train", "--data", corpus_file, "--qk-norm-eps", "0.1", "--out", tmp_path / "x"]), 2,
               "qk_norm_eps is a QK-norm option (pass --attention qknorm)")


def test_the_design_lives_in_its_folder_and_one_registration_line():
    """Adding it touched nothing else of tbp: outside tbp/nn/designs/qknorm, its name is in the
    wing's registration line alone (flags, --config keys, tbp info and the help come from it)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "tbp"
    own = root / "nn" / "designs" / "qknorm"
    naming = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if own not in p.parents
              for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
              if "qknorm" in line.lower() or "qk_norm" in line.lower()]
    assert [n.split(":")[0] for n in naming] == ["nn/designs/__init__.py"], naming
