"""Sparse decoding (LessIsMore and its baselines): the selection rule and exactness."""
import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.nn.designs.sparse.sparse import SparseRule, merge_rank_major, select
from tbp.nn.designs.sparse import twin
from tbp.nn.decode import Inference

pytestmark = pytest.mark.design("rope")      # its models are rotary, as the retrieval study's


def test_the_budget_splits_into_sinks_middle_and_recent():
    assert SparseRule(budget=64).split() == (4, 48, 12)
    assert SparseRule(budget=16, recency=0.5).split() == (4, 8, 4)
    with pytest.raises(ValueError, match="no room"):
        SparseRule(budget=5)


def test_a_hand_built_score_tensor_gives_the_expected_merged_set():
    n = 20
    scores = np.zeros((1, 2, n))
    scores[0, 0, [7, 9, 11]] = [3.0, 2.0, 1.0]          # head 0 ranks 7, 9, 11
    scores[0, 1, [9, 13, 5]] = [3.0, 2.0, 1.0]          # head 1 ranks 9, 13, 5
    rule = SparseRule(budget=10, recency=0.3, sinks=2)     # middle int(0.7 * 10) = 7 -> sinks 2, recent 1
    assert rule.split() == (2, 7, 1)
    kept = select(scores, rule)[0]
    # rank-major: 7 (h0 #1), 9 (h1 #1), 9 again (skipped), 13 (h1 #2), 11 (h0 #3), 5 (h1 #3), then ties at 0
    assert {0, 1}.issubset(kept) and 19 in kept                         # sinks and the recency window
    assert {7, 9, 13, 11, 5}.issubset(kept) and len(set(kept)) == 10 == len(kept)
    assert list(merge_rank_major(scores[0][:, 2:19], 4) + 2) == [7, 9, 13, 11]
    window = select(scores, SparseRule(kind="window", budget=6, sinks=2))[0]
    assert list(window) == [0, 1, 16, 17, 18, 19]
    per_head = select(scores, SparseRule(kind="topk", budget=3))
    assert per_head.shape == (1, 2, 3) and list(per_head[0, 0]) == [7, 9, 11] and list(per_head[0, 1]) == [5, 9, 13]


def model(n_ctx=48):
    cfg = ModelConfig(vocab_size=13, n_ctx=n_ctx, n_layer=3, n_head=2, d_model=16, positions="rope")
    m = GPT(cfg, seed=1, dtype=np.float64)
    for p in m.params.values():
        p += np.random.default_rng(2).standard_normal(p.shape) * 0.3
    return m


@pytest.mark.parametrize("kind", ["lessismore", "topk", "window"])
def test_a_budget_covering_every_position_is_dense_decoding_bit_for_bit(kind):
    m = model()
    tokens = np.random.default_rng(3).integers(0, 13, (2, 40))
    dense, sparse = Inference(m, 2), Inference(m, 2, SparseRule(kind, budget=40, layers=(1,)))
    dense.forward(tokens[:, :4])
    sparse.forward(tokens[:, :4])
    for t in range(4, 40):
        np.testing.assert_array_equal(sparse.forward(tokens[:, t:t + 1]), dense.forward(tokens[:, t:t + 1]))


@pytest.mark.parametrize("kind", ["lessismore", "topk", "window"])
def test_the_gathered_attention_equals_dense_attention_with_the_rest_masked(kind):
    """Each sparse step equals the plain forward in which, after the selection layer, the new
    token's scores are -inf outside the kept set (float64, 1e-12)."""
    m = model()
    tokens = np.random.default_rng(4).integers(0, 13, (2, 44))
    sparse = Inference(m, 2, SparseRule(kind, budget=12, layers=(1,)))
    sparse.forward(tokens[:, :4])
    for t in range(4, 44):
        got = sparse.forward(tokens[:, t:t + 1])[:, -1]
        if t + 1 <= 12:
            assert sparse.last is None                         # nothing to thin yet
            continue
        want = twin.last_logits(m.params, m.config, tokens[:, :t + 1], sparse.last.keep, layer=1)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(t))


def test_a_rule_registered_from_outside_decodes_with_no_edit_of_the_decoder():
    """The rule kinds' registry: a kind registered from outside (here, the last K positions, one
    set for all heads) is built, checked and decoded like the built-in ones, and equals the
    built-in window with no sinks."""
    from tbp.nn.designs.sparse.sparse import SELECTIONS, Selection, selection

    def last_k(scores, rule):
        B, _, n = scores.shape
        return np.broadcast_to(np.arange(n - rule.budget, n), (B, rule.budget)).copy()
    selection("test-last-k")(Selection(last_k))
    try:
        m = model()
        tokens = np.random.default_rng(6).integers(0, 13, (2, 30))
        mine = Inference(m, 2, SparseRule("test-last-k", budget=8, layers=(1,), sinks=0))
        window = Inference(m, 2, SparseRule("window", budget=8, layers=(1,), sinks=0))
        mine.forward(tokens[:, :4])
        window.forward(tokens[:, :4])
        for t in range(4, 30):
            np.testing.assert_array_equal(mine.forward(tokens[:, t:t + 1]), window.forward(tokens[:, t:t + 1]))
        assert mine.last is not None and mine.last.keep is not None
    finally:
        del SELECTIONS["test-last-k"]
    with pytest.raises(ValueError, match="sparse kind must be one of lessismore, topk, window, layer-topk"):
        SparseRule("test-last-k")


def test_a_per_layer_top_k_attends_to_each_layers_own_best_keys():
    """layer-topk: from the selection layer on, each layer's heads attend to their own K best
    positions of that layer's scores -- chosen here by the plain reference itself, not taken
    from the decoder (float64, 1e-12)."""
    m = model()
    tokens = np.random.default_rng(5).integers(0, 13, (2, 40))
    sparse = Inference(m, 2, SparseRule("layer-topk", budget=9, layers=(1,)))
    for t in range(9, 40):
        # a step after a dense prefill: layer 1 is thinned too, so after a run of sparse steps the
        # earlier tokens' keys at layer 2 would be sparse ones, which the plain forward does not make
        sparse.reset()
        sparse.forward(tokens[:, :t])
        got = sparse.forward(tokens[:, t:t + 1])[:, -1]
        want = twin.last_logits(m.params, m.config, tokens[:, :t + 1], None, layer=1, own_top=9)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(t))
        assert sparse.last.keep.shape == (2, 2, 9)                      # the last layer's sets, a set per head


def test_a_selection_layer_past_the_model_is_refused():
    with pytest.raises(ValueError, match="does not exist"):
        Inference(model(), 1, SparseRule(layers=(3,)))


def test_generate_with_sparse_decoding_from_the_cli(tmp_path, corpus_file, monkeypatch):
    from helpers import clean_fail, run, train_tiny
    run_dir = train_tiny(tmp_path, corpus_file, monkeypatch, "r", 5, "--n-layer", 2, "--n-ctx", 64)
    for kind in ("lessismore", "topk", "window"):
        r = run(["generate", "--checkpoint", run_dir, "--max-new-tokens", 60, "--sparse", kind, "--budget", 16,
                 "--seed", 1])
        assert r.exit_code == 0, r.output
    clean_fail(run(["generate", "--checkpoint", run_dir, "--sparse", "topk", "--no-kv-cache"]), 2, "--no-kv-cache")
    clean_fail(run(["generate", "--checkpoint", run_dir, "--sparse", "topk", "--sparse-layers", 5]), 2,
               "the model has 2 layers")


def test_the_stats_line_names_the_sparse_rule_on_one_line(tmp_path, corpus_file, monkeypatch):
    from helpers import run, train_tiny
    out = train_tiny(tmp_path, corpus_file, monkeypatch, "s", 3, "--positions", "rope", "--n-layer", "2")
    r = run(["generate", "--checkpoint", out, "--max-new-tokens", 40, "--sparse", "lessismore", "--budget", 8,
             "--sparse-layers", 1], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stderr.splitlines() if "tokens/s" in x)
    assert "sparse lessismore, budget 8, selection layer 1" in line and len(line) > 80


def test_bench_times_sparse_against_dense_in_one_process():
    import json
    from helpers import clean_fail, run
    r = run(["bench", "--positions", "rope", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--n-ctx", "128",
             "--iters", "1", "--batch-size", "2", "--gen-tokens", "0", "--sparse", "lessismore", "--budget", "16",
             "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["decode_dense_tokens_per_s"] > 0 and d["decode_sparse_tokens_per_s"] > 0
    assert d["decode_sparse_speedup"] > 0 and d["decode_rounds"] >= 1
    assert d["decode_cache"] == 128 - 32 - 1 and d["sparse"]["kind"] == "lessismore" and d["sparse"]["budget"] == 16
    clean_fail(run(["bench", "--attention", "mta", "--n-ctx", "64", "--sparse", "topk", "--budget", "8"]), 2,
               "Multi-Token Attention")
    clean_fail(run(["bench", "--budget", "8"]), 2, "--sparse")
