"""The sparse-decoding studies measure what they say: a retrieval line's last question is
answered only by its fact, far back; decoding every rule from one dense prefill gives what a
fresh decoder gives; the fixed-cache text study scores the tokens after the window's last positions. The
Ghost Attention study's checker accepts exactly the replies that keep an instruction, and its
arms differ where they say they do."""
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "lib"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
import ghost_attention as gatt  # noqa: E402
import retrieval  # noqa: E402
import sparse_decoding  # noqa: E402

from tbp import GPT, ModelConfig  # noqa: E402
from tbp.data.chat import ghost_attention  # noqa: E402
from tbp.nn.designs.sparse.sparse import SparseRule  # noqa: E402
from tbp.nn.decode import Inference


def test_a_retrieval_line_answers_its_last_question_only_from_the_haystack():
    rng = np.random.default_rng(0)
    for length, facts in ((65, 8), (257, 24), (2049, 32)):
        s = retrieval.line(rng, length, facts)
        assert len(s) == length and s.count(retrieval.SEP) == 1
        hay, asked = s.split(retrieval.SEP)
        told = {}
        for c in hay:
            if c in retrieval.RECORDS:
                k, v = divmod(retrieval.RECORDS.index(c), len(retrieval.VALUES))
                assert k not in told                            # no key told twice
                told[k] = v
            else:
                assert c in retrieval.FILLER
        assert len(told) == facts
        questions = [asked[i:i + 3] for i in range(0, len(asked), 3)]
        assert len(questions) * 3 == len(asked) == 3 * max(2, length // 8)
        key = lambda q: retrieval.LETTERS.index(q[0]) * len(retrieval.LETTERS) + retrieval.LETTERS.index(q[1])
        for q in questions:                                     # every question asks a told key, with its value
            assert told[key(q)] == retrieval.VALUES.index(q[2])
        last = questions[-1]
        assert all(q[:2] != last[:2] for q in questions[:-1])   # the last key is asked for the first time
        # and its record is at least the question section's length back
        where = hay.index(retrieval.RECORDS[key(last) * len(retrieval.VALUES) + told[key(last)]])
        assert length - 1 - where >= len(asked)


def test_the_loss_weights_mark_the_questions_values_and_nothing_else():
    tok = retrieval.tokenizer()
    rows = np.array([tok.encode(retrieval.line(np.random.default_rng(s), 65, 8)) for s in range(3)])
    w = retrieval.answer_weights(rows, tok)
    text = [tok.decode(r) for r in rows]
    for t, wr in zip(text, w):
        marked = [i + 1 for i in np.flatnonzero(wr)]            # the positions of the predicted characters
        start = t.index(retrieval.SEP) + 1
        assert marked == list(range(start + 2, len(t), 3))


def _model_and_lines(seed=0, facts=4, lines=5):
    rng = np.random.default_rng(seed)
    tok = retrieval.tokenizer()
    ids = np.array([tok.encode(retrieval.line(rng, 41, facts)) for _ in range(lines)])
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_ctx=64, n_layer=3, n_head=2, d_model=16, positions="rope")
    model = GPT(cfg, seed=seed, dtype=np.float64)
    for name, p in model.params.items():     # larger weights: peaked attention, so that the rules disagree
        if "ln" not in name:
            p *= 8
    return model, ids


@pytest.mark.design("rope")                    # the retrieval study's models are rotary
def test_every_rule_decoded_from_one_prefill_is_a_fresh_decoders_answer():
    model, ids = _model_and_lines()
    n = ids.shape[1]
    rules = [None, SparseRule("window", 8, (1,)), SparseRule("lessismore", 12, (1,)), SparseRule("topk", 6, (1,)),
             SparseRule("lessismore", 10 * n, (1,))]
    got = retrieval.answers(model, ids, rules, batch=2, log=lambda m: None)
    prompt = n - retrieval.ANSWER
    for rule, answer in zip(rules, got):
        for s in range(len(ids)):                               # one sequence at a time, nothing reused
            dec = Inference(model, 1, rule)
            dec.forward(ids[s:s + 1, :prompt - 1])
            want = retrieval.greedy(dec, ids[s, prompt - 1:prompt], retrieval.ANSWER)
            assert (answer[s] == want[0]).all()
    assert (got[-1] == got[0]).all()                            # a budget past the cache is dense
    assert not all((g == got[0]).all() for g in got[1:4])       # and the tight budgets do change something


@pytest.mark.design("rope")                    # the retrieval study's models are rotary
def test_the_fixed_cache_study_scores_each_windows_last_positions():
    model, ids = _model_and_lines(seed=1)
    m = 4
    rules = [None, SparseRule("window", 8, (1,)), SparseRule("topk", 10 * ids.shape[1], (1,))]
    logp = sparse_decoding.last_steps(model, ids, m, rules, batch=2)
    full = model.forward(ids)                                   # (W, n, V), no cache
    full = full - full.max(-1, keepdims=True)
    full = full - np.log(np.exp(full).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp[0], full[:, -m:], atol=1e-10)
    np.testing.assert_allclose(logp[2], logp[0], atol=1e-12)   # a budget past the cache is dense
    assert np.abs(logp[1] - logp[0]).max() > 1e-6


if __name__ == "__main__":
    pytest.main([__file__])


def _instructions():
    name = lambda n: f"name:{n}"
    return [("upper",), ("bang",), (name("Ann"),), ("upper", "bang"), ("bang", name("Cy")), ("upper", name("Eve"))]


def test_the_ghost_attention_checker_accepts_exactly_the_obeying_replies():
    plain = "sky is blue"
    for inst in _instructions():
        assert gatt.keeps(inst, gatt.obey(inst, plain)), inst
        assert not gatt.keeps(inst, plain), inst
        for c in inst:                                  # every constraint is needed: drop one and it fails
            rest = tuple(x for x in inst if x != c)
            if rest:
                assert not gatt.keeps(inst, gatt.obey(rest, plain)), (inst, c)
        assert not gatt.keeps((), gatt.obey(inst, plain)), inst   # with no instruction, plain only
    assert gatt.keeps((), plain)
    assert gatt.obey(("upper", "name:Ann"), plain) == "Ann: SKY IS BLUE"
    assert not gatt.keeps(("name:Ann",), "Bob: sky is blue")
    half = ("upper", "name:Ann")                        # each constraint on its own, as the records count them
    assert gatt.holds("name:Ann", half, "Ann: sky is blue") and not gatt.holds("upper", half, "Ann: sky is blue")
    assert gatt.holds("upper", half, "SKY IS BLUE") and not gatt.holds("name:Ann", half, "SKY IS BLUE")


def test_the_ghost_attention_arms_differ_only_where_they_say():
    rng = random.Random(0)
    drawn = [gatt.dialogue(rng, rng.randint(1, gatt.TRAIN_TURNS)) for _ in range(2000)]
    # the held-out combination is never trained; every trained kind appears
    kinds = {tuple(c.split(":")[0] for c in inst) for inst, _ in drawn}
    assert ("upper", "name") not in kinds and {("upper",), ("bang",), ("name",), ()} <= kinds
    for inst, qa in drawn[:200]:
        consistent = gatt.messages(inst, qa, "consistent")
        made = ghost_attention(gatt.messages(inst, qa, "gatt"))    # what tbp prepare --ghost-attention trains on
        assert [m["content"] for m in made if m["role"] == "user"] == [q for q, _ in qa]   # copies stripped
        if not inst:
            assert made == consistent
            continue
        assert made[0] == consistent[0] and made[-1] == consistent[-1]      # the system message, the sample
        replies = [m["content"] for m in made if m["role"] == "assistant"]
        assert replies[:-1] == [a for _, a in qa[:-1]]                      # the context dialogue: plain
        assert all(gatt.keeps(inst, m["content"]) for m in consistent if m["role"] == "assistant")
        assert ghost_attention(gatt.messages(inst, qa, "sampled")) == consistent   # only the loss differs


def test_a_pair_line_tells_each_key_once_and_the_readers_are_probabilities():
    rng = np.random.default_rng(3)
    for form in ("record", "pair"):
        s = retrieval.line(rng, 257, 16, form=form)
        told = retrieval.facts_of(s)
        assert len(s) == 257 and len(told) == 16
        asked = s.split(retrieval.SEP)[1]
        step = 3 if form == "record" else 2
        keys = []
        for i in range(0, len(asked), step):
            q = asked[i:i + step]
            k = (retrieval.LETTERS.index(q[0]) * len(retrieval.LETTERS) + retrieval.LETTERS.index(q[1])
                 if form == "record" else retrieval.KEYCHARS.index(q[0]))
            assert told[k] == retrieval.VALUES.index(q[-1])     # every question's value is its key's fact
            keys.append(k)
        assert keys[-1] not in keys[:-1]                        # the last key is fresh
        r = retrieval.readers(s, form)
        assert all(0 <= v <= 1 for v in r.values()) and r["in_context"] >= 1 / 16
        if form == "record":
            assert r["second_letter"] >= r["in_context"] * 0.5 and r["second_letter"] > 0


def test_the_facts_rank_is_where_each_layers_scores_put_it():
    tok = retrieval.tokenizer()
    rng = np.random.default_rng(5)
    n = 97
    ids = np.array([tok.encode(retrieval.line(rng, n, 6, form="pair")) for _ in range(3)])
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_ctx=n, n_layer=2, n_head=2, d_model=16,
                            positions="rope"), seed=0, dtype=np.float64)
    got = retrieval.fact_ranks(model, ids, tok, budgets=[4, n - 1], lines=3)
    assert got["lines"] == 3 and len(got["median"]) == 2
    assert got["within"][str(n - 1)] == [1.0, 1.0]            # every position is within the best n - 1
    for layer in range(2):                                     # the same rank, found by sorting
        ranks = []
        for row in ids:
            value_at = tok.decode(row).split(retrieval.SEP)[0].index(tok.decode(row[-2:-1])) + 1
            assert row[value_at] == row[-1] and row[value_at - 1] == row[-2]   # the asked key's told value
            w = model.attention_weights(row[None, :-1])[layer][0, :, -1, :]
            ranks.append(min(int(np.where(np.argsort(-w[h], kind="stable") == value_at)[0][0]) for h in range(2)))
        assert got["median"][layer] == np.median(ranks)
        assert got["within"]["4"][layer] == np.mean(np.array(ranks) < 4)


@pytest.mark.design("rope")                    # the retrieval study's models are rotary
def test_a_retrieval_training_that_gives_up_stops_there_and_says_so(tmp_path, monkeypatch):
    import argparse
    import tables_sparse
    monkeypatch.setattr(retrieval.records, "RESULTS", tmp_path / "results")
    args = argparse.Namespace(out=str(tmp_path / "run"), seed=1, n_layer=1, n_head=2, d_model=16,
                              stages=len(retrieval.STAGES), first=1, init_from=None, force=False, steps=[2, 1, 1, 1],
                              lr_scale=1.0, uniform_filler=False, form="pair", give_up_below=1.01)
    retrieval.train(args)                      # no model is right on every question after two steps
    rec = retrieval.records.read("retrieval_train")[-1]
    assert rec["gave_up"] == {"below": 1.01, "after_stage": 1}
    assert len(rec["stages"]) == 1 and rec["steps"] == 2 and (tmp_path / "run" / "config.json").is_file()
    assert "Stopped after stage 1: held-out accuracy under 101 %" in tables_sparse.retrieval_train([rec])
    args.give_up_below, args.out, args.stages = 0.0, str(tmp_path / "all"), 2
    retrieval.train(args)                      # nothing is under 0: every stage asked for runs
    rec = retrieval.records.read("retrieval_train")[-1]
    assert "gave_up" not in rec and len(rec["stages"]) == 2


@pytest.mark.design("rope")                    # the retrieval study's models are rotary
def test_a_retrieval_run_goes_on_from_its_own_stages_on_lines_it_never_drew(tmp_path, monkeypatch):
    import argparse
    import tables_sparse
    monkeypatch.setattr(retrieval.records, "RESULTS", tmp_path / "results")
    drawn, checking = [], []                   # every training line, per start (the held-out ones are fixed)
    real_line, real_heldout = retrieval.line, retrieval.heldout

    def line(rng, *a):
        got = real_line(rng, *a)
        if not checking:
            drawn[-1].append(got)
        return got

    def heldout(*a, **k):
        checking.append(1)
        try:
            return real_heldout(*a, **k)
        finally:
            checking.pop()
    monkeypatch.setattr(retrieval, "line", line)
    monkeypatch.setattr(retrieval, "heldout", heldout)
    run = str(tmp_path / "run")
    args = argparse.Namespace(out=run, seed=1, n_layer=1, n_head=2, d_model=16, stages=1, first=1, init_from=None,
                              force=False, steps=[2, 1, 1, 1], lr_scale=1.0, uniform_filler=False, form="pair",
                              give_up_below=None)
    drawn.append([])
    retrieval.train(args)
    with pytest.raises(SystemExit, match="already exists"):  # refused before any training, not after
        retrieval.train(args)
    args.init_from, args.force, args.stages = run, True, 2     # stage 1 again, then stage 2
    drawn.append([])
    retrieval.train(args)
    rec = retrieval.records.read("retrieval_train")[-1]
    assert [s["n_ctx"] for s in rec["stages"]] == [96, 96, 128] and rec["steps"] == 2 + 2 + 1
    assert rec["init_from"] == run
    assert not set(drawn[0]) & set(drawn[1])   # the second start draws other lines than the first
    table = tables_sparse.retrieval_train(retrieval.records.read("retrieval_train"))
    assert table.count("**`run`**") == 1 and "| 1 (again) | 96 |" in table and "| 2 | 128 |" in table
