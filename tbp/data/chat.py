"""Conversations: the chat template, conversation datasets with loss masks, Ghost Attention.

Templates. A conversation is its messages in order, each opened by its role and closed, with
role system, user or assistant; a reply is asked for by opening an assistant message. tbp's own
template is ``<|role|> content <|end|>``: the six special tokens (those four, <|endoftext|> and
<|pad|>) are reserved in every tokenizer tbp prepares for chat, char or BPE. A tokenizer that
has ChatML's two instead (``<|im_start|>``, ``<|im_end|>``: SmolLM2's, Qwen's, imported with the
model) is read with ChatML's, ``<|im_start|>role\n content <|im_end|>\n``. Either way a special
token enters a conversation only by id: text is encoded with special-token matching off, so a
message that spells "<|end|><|assistant|>" or "<|im_end|>" is those characters, and no text can
forge a turn; a role's name in ChatML is tbp's fixed text, never the user's.

A chat dataset (``tbp prepare --format chat``, ``meta.json`` kind "chat") holds one row per
conversation, kept whole::

    train.bin  val.bin     token ids, conversation after conversation
    train.mask val.mask    uint8 beside every token: 1 where the loss predicts it
    train.idx  val.idx     int64 (n,): each conversation's length in tokens

``loss``: "assistant" (default) puts the loss on every assistant reply's content and its
<|end|> (not on its <|assistant|> token: that one is given, it asks for the reply); "last" on
the last reply only; "all" on every token after the first (plain language modelling).

Ghost Attention (Touvron et al. 2023, Llama 2, §3.3): a conversation whose replies were
made with the system instruction attached to every user message is trained with the
instruction given once -- the system message -- and the loss on the last reply only, so that
the model learns to keep obeying an instruction it saw turns ago. ``ghost_attention`` removes
a copy of the system message from the start or end of every user message (where the data
still carries it) and sets the loss to "last" unless told otherwise. Where the paper leaves a
choice: each conversation is one row (its earlier replies are context with no loss, whoever
wrote them); dialogues of varied lengths give the last-reply signal at every depth.
"""
from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import jsonio, schema
from .prepare import (DEFAULT_BPE_VOCAB, Kind, PrepareReport, claim, dataset_name, default_out, read_file,
                      row_starts, versions, write_dataset)
from ..errors import TbpError
from .tokenizer import (ASSISTANT, CHAT_SPECIALS, END, EOT, PAD, SYSTEM, USER, Tokenizer, token_dtype,
                        train_bpe, train_char)

ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
LOSSES = ("assistant", "last", "all")
CHAT_META = {"train_examples": int, "val_examples": int, "max_example_tokens": int, "end_id": int,
             "pad_id": int, "eot_id": int, "assistant_id?": int, "user_id?": int, "system_id?": int, "template?": str,
             "loss": str, "ghost_attention": bool, "val_target_tokens": int, "val_target_bytes": int}


IM_START, IM_END = "<|im_start|>", "<|im_end|>"          # ChatML's two special tokens


@dataclass(frozen=True)
class Template:
    """A chat template as token ids. ``opens[role]``: the ids that begin a message of ``role``
    (one role token, or ChatML's <|im_start|> and the role's name and a newline); ``close``: the
    ids after its content (<|end|>, or <|im_end|> and a newline), whose first, ``stop``, ends a
    reply; ``banned``: ids a reply never holds; ``eot`` and ``pad``: end of text, padding."""
    name: str
    opens: dict
    close: tuple
    eot: int
    pad: int
    banned: tuple

    @property
    def stop(self) -> int:
        return self.close[0]

    def role_of(self, ids: list[int], i: int) -> tuple[str, int] | None:
        """(role, the index after its opening) where a message opens at ids[i], else None."""
        for role, seq in self.opens.items():
            if tuple(ids[i:i + len(seq)]) == seq:
                return role, i + len(seq)
        return None


_TEMPLATES: "weakref.WeakKeyDictionary[Tokenizer, Template]" = weakref.WeakKeyDictionary()


def template(tok: Tokenizer) -> Template:
    """The template ``tok`` was made for: tbp's where it has tbp's six reserved tokens, ChatML's
    where it has <|im_start|> and <|im_end|>; TbpError otherwise (it was not made for chat).
    Found once per tokenizer (render asks it for every conversation of a dataset)."""
    found = _TEMPLATES.get(tok)
    if found is None:
        found = _TEMPLATES[tok] = _find_template(tok)
    return found


def _find_template(tok: Tokenizer) -> Template:
    vocab = tok.hf.get_vocab()
    if all(s in vocab for s in CHAT_SPECIALS):
        opens = {role: (vocab[token],) for role, token in ROLES.items()}
        return Template("tbp", opens, (vocab[END],), vocab[EOT], vocab[PAD],
                        (vocab[SYSTEM], vocab[USER], vocab[ASSISTANT], vocab[PAD]))
    if IM_START in vocab and IM_END in vocab:
        start, end = vocab[IM_START], vocab[IM_END]
        opens = {role: (start, *tok.encode(role + "\n")) for role in ROLES}
        eot = vocab.get(EOT, end)
        banned = tuple(vocab[t] for t in (IM_START, *CHAT_SPECIALS) if t in vocab and vocab[t] not in (end, eot))
        return Template("chatml", opens, (end, *tok.encode("\n")), eot, vocab.get(PAD, eot), banned)
    missing = [s for s in CHAT_SPECIALS if s not in vocab]
    raise TbpError(f"the tokenizer has no {', '.join(missing)} (tbp's chat template) and no {IM_START}, {IM_END} "
                   f"(ChatML's): it was not made for conversations (tbp prepare --format chat)")


# --- reading ----------------------------------------------------------------------------------
def check_messages(messages, where: str, need_reply: bool = True) -> list[dict]:
    """The messages of one conversation, checked: an optional system message first, then user
    and assistant in turn, starting with the user; string contents (a literal "<|end|>" in one is
    text like any other: the tokenizer never matches reserved tokens in text)."""
    if not isinstance(messages, list) or not messages:
        raise TbpError(f"{where}: \"messages\" must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES \
                or not isinstance(m.get("content"), str):
            raise TbpError(f'{where}: message {i + 1} must be {{"role": "system"|"user"|"assistant", '
                           f'"content": "..."}}')
        out.append({"role": m["role"], "content": m["content"]})
    first = 1 if out[0]["role"] == "system" else 0
    for i, m in enumerate(out[first:]):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise TbpError(f"{where}: message {first + i + 1} is {m['role']}, expected {want} "
                           f"(an optional system message, then user and assistant in turn)")
    if need_reply and not any(m["role"] == "assistant" for m in out):
        raise TbpError(f"{where}: no assistant message to learn from")
    return out


def read_conversations(path: str, encoding: str = "utf-8",
                       need_reply: bool = True) -> tuple[list, str, str, list[int]]:
    """(conversations, name, source, line numbers) from a JSON-lines file (or '-'), one
    conversation per line: ``{"messages": [{"role": ..., "content": ...}, ...]}``. Blank lines
    are skipped."""
    text, where, name = read_file(path, encoding, "file of conversations")
    convs, numbers = [], []
    for n, obj in jsonio.read_jsonl(text, where):
        if not isinstance(obj, dict) or "messages" not in obj:
            raise TbpError(f'{where}:{n}: expected {{"messages": [...]}}')
        convs.append(check_messages(obj["messages"], f"{where}:{n}", need_reply))
        numbers.append(n)
    if not convs:
        raise TbpError(f"{where}: no conversations")
    return convs, name, where, numbers


# --- the template -----------------------------------------------------------------------------
def render(tok: Tokenizer, messages: list[dict], loss: str = "assistant",
           where: str = "message") -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a conversation in the tokenizer's template; mask[i] = 1 where the loss
    predicts ids[i]: a trained message's content and its ``stop`` (never its opening, which is
    given, nor the rest of its close). Contents are text: encoded with special-token matching
    off, never a role or an end."""
    tpl = template(tok)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    parts, masks = [], []
    for i, m in enumerate(messages):
        body = tok.encode(m["content"], where) if m["content"] else []
        opening = tpl.opens[m["role"]]
        trained = loss == "all" or (m["role"] == "assistant" and (loss == "assistant" or i == replies[-1]))
        parts.append([*opening, *body, *tpl.close])
        masks.append([0] * len(opening) + [int(trained)] * (len(body) + 1) + [0] * (len(tpl.close) - 1))
    out_ids = np.array([t for seg in parts for t in seg], dtype=np.int64)
    mask = np.array([b for seg in masks for b in seg], dtype=np.uint8)
    if loss == "all" and mask.size:
        mask[0], mask[1:] = 0, 1
    return out_ids, mask


def prompt_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    """The tokens that ask for the next reply: the messages so far, then an assistant's opening."""
    ids, _ = render(tok, messages, "all")
    return [*ids.tolist(), *template(tok).opens["assistant"]]


def parse(tok: Tokenizer, ids) -> list[dict]:
    """The messages of template tokens (the inverse of ``render``)."""
    tpl = template(tok)
    ids = [int(i) for i in ids]
    out, body, role, i = [], [], None, 0
    while i < len(ids):
        opened = tpl.role_of(ids, i)
        if opened is not None:
            (role, i), body = opened, []
            continue
        if ids[i] == tpl.stop and role is not None:
            out.append({"role": role, "content": tok.decode(body)})
            role, i = None, i + len(tpl.close)
            continue
        body.append(ids[i])
        i += 1
    return out


def ghost_attention(messages: list[dict]) -> list[dict]:
    """Llama 2's Ghost Attention data: the system instruction once, at the start. A user message
    that still carries it (attached at its start or end, as the replies were made) loses it."""
    if messages[0]["role"] != "system" or not messages[0]["content"].strip():
        return messages
    inst = messages[0]["content"].strip()
    out = [messages[0]]
    for m in messages[1:]:
        text = m["content"]
        if m["role"] == "user":
            text = strip_instruction(text, inst)
        out.append({"role": m["role"], "content": text})
    return out


def strip_instruction(text: str, inst: str) -> str:
    """``text`` without a copy of ``inst`` attached at its start or end -- attached meaning set
    apart by whitespace (or the whole message): "French\nHello" loses it, "Frenchmen style"
    does not."""
    stripped = text.strip()
    if stripped == inst:
        return ""
    if stripped.startswith(inst) and stripped[len(inst)].isspace():
        return stripped[len(inst):].lstrip()
    if stripped.endswith(inst) and stripped[-len(inst) - 1].isspace():
        return stripped[:-len(inst)].rstrip()
    return text


def fit(tok: Tokenizer, messages: list[dict], max_tokens: int) -> list[dict] | None:
    """The longest prefix of whole messages ending with a reply that fits ``max_tokens`` tokens
    (None if even the first reply does not): a conversation is never cut inside a message."""
    best, used = None, 0
    for i, m in enumerate(messages):
        used += 2 + len(tok.encode(m["content"]))
        if used > max_tokens:
            break
        if m["role"] == "assistant":
            best = messages[:i + 1]
    return best


# --- preparing --------------------------------------------------------------------------------
def prepare_chat(convs: list[list[dict]], name: str, source: str, out: str | Path | None = None,
                 tokenizer_kind: str = "char", vocab_size: int | None = None, val_fraction: float = 0.1,
                 force: bool = False, loss: str | None = None, ghost: bool = False,
                 max_tokens: int | None = None, tokenizer: Tokenizer | None = None,
                 report: PrepareReport | None = None, origin: dict | None = None) -> dict:
    """Render conversations into a chat dataset folder, written atomically; returns its meta."""
    report = report or PrepareReport()
    loss = loss or ("last" if ghost else "assistant")
    if loss not in LOSSES:
        raise TbpError(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
    out = Path(out) if out else default_out(dataset_name(name, tokenizer_kind, vocab_size))
    claim(out, force, (source,) if Path(source).exists() else (), val_fraction)
    t0 = time.perf_counter()
    if ghost:
        convs = [ghost_attention(c) for c in convs]
    texts = [m["content"] for c in convs for m in c]
    if tokenizer is None:
        tokenizer = train_char("".join(texts), CHAT_SPECIALS) if tokenizer_kind == "char" else \
            train_bpe(texts, vocab_size or DEFAULT_BPE_VOCAB, CHAT_SPECIALS)
    else:
        template(tokenizer)
        tokenizer.check("".join(texts), source)
    cut = dropped = 0
    if max_tokens is not None:
        kept = []
        for c in convs:
            f = fit(tokenizer, c, max_tokens)
            dropped += f is None
            cut += f is not None and len(f) < len(c)
            if f is not None:
                kept.append(f)
        convs = kept
    n_val = max(1, round(len(convs) * val_fraction))
    if len(convs) - n_val < 1:
        raise TbpError(f"{source}: {len(convs)} conversation(s) leave nothing to train on after the "
                       f"validation split" + (f" ({dropped} did not fit --max-tokens)" if dropped else ""))
    report.start(name, sum(len(t) for t in texts))
    splits = {"train": convs[:len(convs) - n_val], "val": convs[len(convs) - n_val:]}
    dtype = token_dtype(tokenizer.vocab_size)
    encoded = {}
    for split, items in splits.items():
        rows = [render(tokenizer, c, loss) for c in items]
        ids = np.concatenate([r[0] for r in rows] or [np.zeros(0, np.int64)]).astype(dtype)
        mask = np.concatenate([r[1] for r in rows] or [np.zeros(0, np.uint8)])
        encoded[split] = ids, mask, np.array([len(r[0]) for r in rows], dtype=np.int64)
    tpl = template(tokenizer)
    val_mask = encoded["val"][1]
    meta = {
        "format": 1, "kind": "chat", "tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "vocab_size_asked": tokenizer.asked,
        "dtype": dtype.name, "eot_id": tpl.eot, "pad_id": tpl.pad, "end_id": tpl.stop, "template": tpl.name,
        # the role tokens, where the template has one per role
        **({f"{role}_id": seq[0] for role, seq in tpl.opens.items()} if tpl.name == "tbp" else {}),
        "loss": loss, "ghost_attention": ghost, "max_tokens": max_tokens, "cut": cut, "dropped": dropped,
        "train_examples": len(splits["train"]), "val_examples": len(splits["val"]),
        "train_tokens": int(encoded["train"][0].size), "val_tokens": int(encoded["val"][0].size),
        "train_bytes": sum(len(t.encode("utf-8")) for c in splits["train"] for t in (m["content"] for m in c)),
        "val_bytes": sum(len(t.encode("utf-8")) for c in splits["val"] for t in (m["content"] for m in c)),
        "val_target_tokens": int(val_mask.sum()),
        "val_target_bytes": sum(_trained_bytes(c, loss) for c in splits["val"]),
        "max_example_tokens": int(max(encoded["train"][2].max(), encoded["val"][2].max(initial=0))),
        "characters": sum(len(t) for t in texts), "val_fraction": val_fraction, "source": source,
        "source_sha256": hashlib.sha256(json.dumps(convs).encode("utf-8")).hexdigest(),
        "tokenizer_sha256": tokenizer.sha256(), "name": name, "versions": versions(), "seconds": 0.0,
    }
    if origin:
        meta["task"] = origin
    report.advance(meta["characters"])
    arrays = {f"{split}.{ext}": a for split, (ids, mask, lengths) in encoded.items()
              for ext, a in (("bin", ids), ("mask", mask), ("idx", lengths))}
    return write_dataset(out, force, tokenizer, arrays, meta, t0, report)


def _trained_bytes(messages: list[dict], loss: str) -> int:
    """UTF-8 bytes of the text the loss is on (bits per byte are of it)."""
    replies = [m for m in messages if m["role"] == "assistant"]
    trained = messages if loss == "all" else replies[-1:] if loss == "last" else replies
    return sum(len(m["content"].encode("utf-8")) for m in trained)


# --- loading ----------------------------------------------------------------------------------
@dataclass
class ChatSplit:
    """One split's conversations: row i is tokens[start[i]:start[i] + length[i]], with its mask."""
    tokens: np.ndarray
    mask: np.ndarray
    length: np.ndarray
    start: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a = int(self.start[i])
        b = a + int(self.length[i])
        return np.asarray(self.tokens[a:b], np.int64), np.asarray(self.mask[a:b])


def load_split(path: Path, split: str, tokens: np.ndarray, meta: dict) -> ChatSplit:
    n = meta[f"{split}_examples"]
    f, fm = path / f"{split}.idx", path / f"{split}.mask"
    if f.stat().st_size != n * 8:
        raise TbpError(f"{f}: {f.stat().st_size} bytes, meta.json says {n} conversations; the file is damaged")
    length = np.fromfile(f, dtype=np.int64)
    bound = min(tokens.size, meta.get("max_example_tokens", tokens.size))
    if (length < 2).any() or (length > bound).any():
        raise TbpError(f"{f}: a conversation length is out of range (2 .. {bound}); the file is damaged")
    start = row_starts(length, tokens.size, f, split, "conversation")
    if fm.stat().st_size != tokens.size:
        raise TbpError(f"{fm}: {fm.stat().st_size} bytes, one per token of {split}.bin ({tokens.size}) expected")
    mask = np.memmap(fm, dtype=np.uint8, mode="r") if tokens.size else np.zeros(0, np.uint8)
    if mask.size and (mask.max() > 1 or (np.add.reduceat(mask, start, dtype=np.int64) == 0).any()):
        raise TbpError(f"{fm}: every conversation needs a token the loss is on (mask values 0 or 1, "
                       f"at least one 1 per conversation); the file is damaged")
    return ChatSplit(tokens, mask, length, start)


def check_meta(meta: dict, where: str) -> None:
    schema.check(meta, CHAT_META, where)


KIND = Kind("chat", ("train.idx", "val.idx", "train.mask", "val.mask"), check_meta, load_split)
