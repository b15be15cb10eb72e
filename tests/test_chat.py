"""Conversations: the template, the loss masks, Ghost Attention data, and tbp chat."""
import json

import numpy as np
import pytest

from tbp.data import chat
from tbp.generate.conversation import Conversation
from tbp.data.datasets import Dataset
from tbp.errors import TbpError
from tbp.generate.sampling import Sampling
from tbp.nn.gpt import GPT
from tbp.nn.config import ModelConfig
from tbp.data.tokenizer import CHAT_SPECIALS, train_char

from helpers import clean_fail, run, tiny

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "why"},
        {"role": "assistant", "content": "ok"}]


def tokenizer():
    return train_char("Be brief. hiyowk", CHAT_SPECIALS)


def test_the_template_round_trips():
    tok = tokenizer()
    ids, _ = chat.render(tok, CONV)
    assert chat.parse(tok, ids) == CONV
    assert tok.decode(ids) == "<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>yo<|end|>" \
                              "<|user|>why<|end|><|assistant|>ok<|end|>"


@pytest.mark.parametrize("loss,trained", [
    ("assistant", "yo<|end|>ok<|end|>"),            # every reply and its end, not the role token
    ("last", "ok<|end|>"),
    ("all", None),
])
def test_the_mask_covers_exactly_the_tokens_it_should(loss, trained):
    tok = tokenizer()
    ids, mask = chat.render(tok, CONV, loss)
    if trained is None:
        assert mask[0] == 0 and mask[1:].all()
    else:
        assert tok.decode(ids[mask == 1]) == trained


def test_ghost_attention_keeps_the_instruction_once_at_the_start():
    inst = "Reply in upper case."
    msgs = [{"role": "system", "content": inst}, {"role": "user", "content": f"the sky? {inst}"},
            {"role": "assistant", "content": "THE SKY IS BLUE"}, {"role": "user", "content": f"{inst} the sea?"},
            {"role": "assistant", "content": "THE SEA IS BLUE"}]
    out = chat.ghost_attention(msgs)
    assert [m["content"] for m in out] == [inst, "the sky?", "THE SKY IS BLUE", "the sea?", "THE SEA IS BLUE"]
    no_system = msgs[1:]
    assert chat.ghost_attention(no_system) == no_system


def write(path, convs):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))


def dialogues(n=60):
    things = {"sky": "blue", "coal": "black", "snow": "white"}
    out = []
    for i in range(n):
        t = list(things)[i % 3]
        u = list(things)[(i + 1) % 3]
        out.append([{"role": "system", "content": "Be loud."}, {"role": "user", "content": f"the {t}?"},
                    {"role": "assistant", "content": f"THE {t.upper()} IS {things[t].upper()}"},
                    {"role": "user", "content": f"the {u}?"},
                    {"role": "assistant", "content": f"THE {u.upper()} IS {things[u].upper()}"}])
    return out


def test_prepare_chat_cuts_at_whole_messages_and_names_bad_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "d.jsonl", dialogues())
    r = run(["prepare", "--format", "chat", "--data", "d.jsonl", "--max-tokens", "40"])
    assert r.exit_code == 0, r.output
    ds = Dataset.load(tmp_path / "data" / "d")
    assert ds.kind == "chat" and ds.meta["cut"] == 60 and ds.meta["dropped"] == 0
    seq, mask = ds.train.row(0)
    got = chat.parse(ds.tokenizer, seq)
    assert got == dialogues()[0][:3] and len(seq) <= 40           # cut after the first whole reply
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n'
                                        '{"messages": [{"role": "assistant", "content": "a"}]}\n')
    clean_fail(run(["prepare", "--format", "chat", "--data", "bad.jsonl"]), 1, "bad.jsonl:1: no assistant message")
    (tmp_path / "bad2.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}, '
                                         '{"role": "user", "content": "b"}]}\n')
    clean_fail(run(["prepare", "--format", "chat", "--data", "bad2.jsonl"]), 1, "bad2.jsonl:1: message 2 is user")
    (tmp_path / "bad3.jsonl").write_text("not json\n")
    clean_fail(run(["prepare", "--format", "chat", "--data", "bad3.jsonl"]), 1, "bad3.jsonl:1: not valid JSON")
    clean_fail(run(["prepare", "--data", "d.jsonl", "--ghost-attention"]), 2, "are for --format chat")


@pytest.fixture
def chat_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "d.jsonl", dialogues())
    assert run(["prepare", "--format", "chat", "--data", "d.jsonl", "--ghost-attention"]).exit_code == 0
    r = run(["train", "--data", "data/d", "--out", "run", "--max-iters", "20", *tiny(n_ctx=72)])
    assert r.exit_code == 0, r.output
    return tmp_path / "run"


def test_chat_through_a_pipe_equals_the_messages_file(chat_run, tmp_path):
    r = run(["chat", "--checkpoint", chat_run, "--system", "Be loud.", "--seed", "3", "--max-new-tokens", "12"],
            input="the sky?\nthe coal?\n")
    assert r.exit_code == 0, r.output
    piped = r.stdout.splitlines()[:2]
    convo = [{"role": "system", "content": "Be loud."}, {"role": "user", "content": "the sky?"},
             {"role": "user", "content": "the coal?"}]
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": [convo[0], convo[1],
                                                  {"role": "assistant", "content": "ignored"}, convo[2]]}) + "\n")
    r = run(["chat", "--checkpoint", chat_run, "--messages", "m.jsonl", "--seed", "3", "--max-new-tokens", "12"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["messages"]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert [out[2]["content"], out[4]["content"]] == piped


def test_the_cache_kept_across_turns_gives_the_full_forward_replies(chat_run):
    from tbp.runs import disk
    model, tok, _ = disk.load_model(chat_run, dtype=np.float64)
    talk = Conversation(model, tok, "Be loud.", Sampling(temperature=0), max_reply=10)
    for q in ("the sky?", "the snow?", "the coal?"):
        "".join(talk.reply(q))
    tpl = chat.template(tok)
    ids = chat.render(tok, talk.messages, "all")[0]
    logits = model.forward(ids[None, :-1])[0]
    logits[:, list(tpl.banned)] = -np.inf
    _, mask = chat.render(tok, talk.messages, "assistant")
    greedy = logits.argmax(-1)
    # every reply token was the argmax of the full forward over the whole history (an <|end|>
    # may be tbp's, closing a reply at max_reply: those are left out)
    chosen = (mask[1:] == 1) & (ids[1:] != tpl.stop)
    assert chosen.sum() >= 10
    assert np.array_equal(greedy[chosen], ids[1:][chosen])


def test_a_full_context_drops_the_oldest_turns_and_keeps_the_instruction(chat_run):
    from tbp.runs import disk
    model, tok, _ = disk.load_model(chat_run)
    talk = Conversation(model, tok, "Be loud.", Sampling(temperature=0), max_reply=8)
    for _ in range(12):
        "".join(talk.reply("the sky?"))
    assert talk.refills > 0
    assert len(talk.cached) <= model.config.n_ctx
    assert chat.parse(tok, talk.cached)[0] == {"role": "system", "content": "Be loud."}
    before, cached = list(talk.messages), list(talk.cached)
    with pytest.raises(TbpError, match="message: (at least )?180 tokens; .* does not fit this model.s context of 72"):
        "".join(talk.reply("the sky? " * 20))
    assert talk.messages == before and talk.cached == cached       # refused whole: nothing changed
    "".join(talk.reply("the sky?"))
    assert [m["role"] for m in talk.messages[-2:]] == ["user", "assistant"]


def test_a_tokenizer_without_the_template_is_refused():
    with pytest.raises(TbpError, match="not made for conversations"):
        Conversation(GPT(ModelConfig(vocab_size=20, n_ctx=16)), train_char("abc"))


@pytest.mark.parametrize("loss,tokens,nbytes", [("last", 3, 2), ("assistant", 6, 4)])
def test_bits_per_byte_are_of_what_the_loss_is_on(tmp_path, loss, tokens, nbytes):
    meta = chat.prepare_chat([CONV, CONV], "c", "test", tmp_path / "c", val_fraction=0.5, loss=loss)
    assert meta["val_target_tokens"] == tokens          # "ok" + <|end|> (and "yo" + <|end|>)
    assert meta["val_target_bytes"] == nbytes


def test_generate_on_a_chat_model_stops_at_the_end_marker_and_points_to_chat(chat_run):
    r = run(["generate", "--checkpoint", chat_run, "--prompt", "the sky?", "--max-new-tokens", 200,
             "--seed", 1, "--num-samples", 3])
    assert r.exit_code == 0, r.output
    assert "<|end|>" not in r.stdout and "tbp chat --checkpoint" in r.stderr


@pytest.mark.parametrize("speculate", ["lookup", "itself"])
def test_a_speculative_conversation_equals_the_plain_one_in_float64(chat_run, speculate):
    """Greedy replies, the cache's tokens and the refills are the same with speculative decoding:
    drafts kept past a reply's end are rolled back."""
    from tbp.generate.speculative import Draft, Lookup
    from tbp.runs import disk
    model, tok, _ = disk.load_model(chat_run, dtype=np.float64)
    talks = [Conversation(model, tok, "Be loud.", Sampling(temperature=0), max_reply=8, drafter=d)
             for d in (None, Lookup(2, 4) if speculate == "lookup" else Draft(model, 4))]
    for q in ("the sky?", "the snow?", "the coal?") * 4:
        assert "".join(talks[0].reply(q)) == "".join(talks[1].reply(q))
        assert talks[0].cached == talks[1].cached and talks[0].decoder.length == talks[1].decoder.length
    assert talks[0].messages == talks[1].messages and talks[1].refills == talks[0].refills > 0
    assert talks[1].tally.forwards + talks[1].tally.accepted == talks[1].tally.tokens
    if speculate == "itself":
        assert talks[1].tally.drafted > 0 and talks[1].tally.acceptance == 1.0


def test_chat_with_lookup_prints_the_same_greedy_replies(chat_run):
    args = ["chat", "--checkpoint", chat_run, "--temperature", "0", "--max-new-tokens", "12"]
    plain = run(args, input="the sky?\nthe coal?\n")
    spec = run([*args, "--lookup"], input="the sky?\nthe coal?\n")
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and "tokens a forward" in spec.stderr
