"""Checkpoints of the previous release load unchanged: one committed run per design, each with
its options off their defaults, gives the logits that release computed (tests/data/release4_runs)."""
from pathlib import Path

import numpy as np
import pytest

import tbp

RUNS = Path(__file__).parent / "data" / "release4_runs"
DESIGNS = Path(tbp.__file__).parent / "nn" / "designs"
# each run is named for its design's folder (standard: none); a tree without that folder has no row
THERE = sorted(p.name for p in RUNS.iterdir() if p.is_dir() and (p.name == "standard" or (DESIGNS / p.name).is_dir()))


@pytest.mark.parametrize("name", THERE)
def test_a_run_of_the_previous_release_gives_its_logits(name):
    model = tbp.load(RUNS / name)
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    if model.config.arch == "encoder-decoder":
        src, tgt = rng.integers(1, V, (1, 6)), rng.integers(1, V, (1, 5))
        logits = model.forward(src, tgt)
    else:
        logits = model.forward(rng.integers(0, V, (1, 10)))
    np.testing.assert_allclose(logits, np.load(RUNS / name / "logits.npy"), rtol=1e-5, atol=1e-6)


@pytest.mark.design("mta", "gqa", "rope", "attnres", "encdec", "alibi", "flash")
def test_the_fixtures_cover_every_design_with_options():
    """Each run switches its design on with options away from their defaults (what must survive)."""
    import json
    models = {p.name: json.loads((p / "config.json").read_text())["model"] for p in RUNS.iterdir() if p.is_dir()}
    assert models["mta"]["mta_ck"] == 3 and models["mta"]["mta_post"] and models["mta"]["mta_layers"] == "1"
    assert models["gqa"]["n_kv_head"] == 2 and models["rope"]["rope_base"] == 500.0
    assert models["attnres"]["residual_blocks"] == 2 and models["attnres"]["residual_query_scale"] == 0.5
    assert models["encdec"]["n_enc_layer"] == 1 and models["encdec"]["pad_id"] is not None
    assert models["alibi"]["positions"] == "alibi" and models["flash"]["attn_impl"] == "flash"


@pytest.mark.parametrize("old, key, new", [
    pytest.param({"attention": "gqa", "n_kv_head": 2}, "gqa", {"n_kv_head": 2}, marks=pytest.mark.design("gqa")),
    pytest.param({"attention": "mta", "mta_ck": 3, "mta_post": True}, "mta", {"ck": 3, "post": True},
                 marks=pytest.mark.design("mta")),
    pytest.param({"positions": "rope", "rope_base": 500.0}, "rope", {"base": 500.0}, marks=pytest.mark.design("rope")),
    pytest.param({"residual": "attention", "residual_blocks": 2}, "attnres", {"blocks": 2},
                 marks=pytest.mark.design("attnres")),
    pytest.param({"arch": "encoder-decoder", "n_enc_layer": 1, "pad_id": 3}, "encoder-decoder",
                 {"n_enc_layer": 1, "pad_id": 3}, marks=pytest.mark.design("encdec"))])
def test_a_designs_option_as_a_model_config_keyword_is_mapped_with_a_warning_naming_the_new_spelling(old, key, new):
    from tbp.nn.config import ModelConfig
    with pytest.warns(FutureWarning, match=r"live with the design now; pass designs=") as said:
        cfg = ModelConfig(vocab_size=11, **old)
    assert repr({key: new}) in str(said[0].message)
    spelled = ModelConfig(vocab_size=11, **{k: v for k, v in old.items() if k in ("attention", "positions", "residual",
                                                                                  "arch")}, designs={key: new})
    assert cfg == spelled and all(getattr(cfg.designs[key], k) == v for k, v in new.items())
