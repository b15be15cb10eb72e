"""GGUF files that llama.cpp runs: a tbp GPT written as one of llama.cpp's own architectures.

llama.cpp builds a fixed graph per architecture, so a file is only right if an existing graph
computes exactly tbp's function. Three do:

- ``gpt2`` for learned positions: token + position embeddings, pre-norm blocks (LayerNorm,
  one fused q|k|v product, softmax(q k^T / sqrt(Dk)) v, output projection; LayerNorm, tanh-GELU
  MLP), a final LayerNorm and the head -- tied to the embedding when ``output.weight`` is absent.
- ``gptneox`` with ``use_parallel_residual`` false for rotary positions: the same block with
  queries and keys rotated in NeoX's pairing (i, i + Dk/2), which is tbp's (nn/designs/rope), over all
  Dk channels, at the rotation's base. Its head is always a separate tensor: a tied model writes the
  embedding twice.

- ``llama`` for a model of Llama blocks (interop/llama.py: RMSNorm, SwiGLU, rotary positions, no
  biases, a tied head or an untied one without bias): separate q, k, v, gate and up matrices, and
  RMSNorm's epsilon. llama.cpp's llama graph rotates *adjacent* channels (2i, 2i + 1), where tbp
  and Hugging Face rotate (i, i + Dk/2): within each head the query and key rows are reordered so
  that channel i + j Dk/2 (j = 0, 1) lands at 2i + j -- the same function, with the pairs where
  llama.cpp's rotation looks for them (:func:`interleave`).

All read n_head_kv, and split a fused row as q | k | v with query head h reading key/value head
h // (H / Hkv) -- tbp's grouped-query layout -- so grouped-query attention maps too. Both require
every bias: a model without biases gets zeros (adding zero is the same function). Neither has a
bias on the head (tbp's untied head always has one: only a tied head exports), a ReLU MLP, or any of Multi-Token Attention, Attention Residuals or the
encoder-decoder: those are refused, never written as a file that loads and computes something else.

Layout. GGUF lists a tensor's dimensions fastest first (ggml's ne), NumPy slowest first, so a
ggml {n_embd, n_vocab} is a NumPy (V, C) array. llama.cpp multiplies x by a weight stored
(out, in); tbp stores linear weights (in, out) (GPT-2's Conv1D), so each one is transposed.

Tokenizers. A byte-level BPE is llama.cpp's ``gpt2`` tokenizer model with the ``gpt-2``
pre-tokenizer (the same regex), its vocabulary and merges as they are. A char tokenizer's tokens
are single characters: without reserved tokens it is written as the ``rwkv`` model, a greedy
longest match over the tokens' bytes -- one token per character, and no end-of-generation token
(the ``gpt2`` model would end generation at id 11, a character). With reserved tokens (a pairs or
chat dataset) it is the ``gpt2`` model with each character in byte-level form and a merge for each
two-byte character; a character of three or more bytes would need tokens the model does not have,
and is refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import TbpError
from ..files.atomic import atomic_file, refuse_inputs
from ..nn.gpt import GPT
from ..nn.config import ModelConfig
from ..nn import build
from ..nn.parts import parts
from ..data.chat import IM_END, IM_START
from ..data.tokenizer import ASSISTANT, END, EOT, Tokenizer
from . import llama

TYPES = ("f32", "f16", "q8_0")
MARK = "tbp.version"              # a metadata key only tbp writes: --force replaces only such files
Q8_BLOCK = 32                     # q8_0 quantizes rows in blocks of 32 values


def architecture(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for ``cfg``: "llama", "gpt2" or "gptneox"; TbpError naming every
    reason it has none."""
    if llama.is_llama(cfg):
        return "llama"
    problems = []
    why = build.refusal(cfg, "gguf")
    if why:
        problems.append(why)
    if cfg.arch != "gpt" and not why:
        problems.append(f"arch {cfg.arch}: llama.cpp's gpt2 is decoder-only")
    if cfg.activation != "gelu":
        problems.append(f"activation {cfg.activation}: llama.cpp's gpt2 and gptneox MLPs use GELU")
    if cfg.d_qk != cfg.d_v:
        problems.append(f"query/key width {cfg.d_qk} != value width {cfg.d_v}: llama.cpp's gpt2 and "
                        f"gptneox have one head width")
    if not cfg.causal:
        problems.append("attention without the causal mask")
    if problems:
        raise TbpError("llama.cpp has no architecture that computes this model: " + "; ".join(problems))
    return "gptneox" if cfg.positions == "rope" else "gpt2"


def _linear(params: dict, name: str, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight (out, in), bias (out,)) of a tbp linear layer (weight (in, out)); zeros for no bias."""
    w = params[name + ".weight"]
    b = params.get(name + ".bias")
    return np.ascontiguousarray(w.T), (np.zeros(n_out, np.float32) if b is None else b)


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows (heads D, in) of a query or key matrix, each head's row i + j D/2 (j = 0, 1) moved to
    2i + j: rotate-half's pairs (i, i + D/2) become the adjacent pairs llama.cpp's llama graph rotates."""
    D = w.shape[0] // heads
    return np.ascontiguousarray(w.reshape(heads, 2, D // 2, -1).swapaxes(1, 2).reshape(w.shape))


def _llama_tensors(cfg: ModelConfig, p: dict) -> dict[str, np.ndarray]:
    """The llama architecture's tensors (HF's matrices, llama.py's table, in llama.cpp's names),
    the query and key rows interleaved."""
    hf = llama.to_hf(p, cfg)
    Hkv = hf["model.layers.0.self_attn.k_proj.weight"].shape[0] // cfg.d_v
    out = {"token_embd.weight": hf["model.embed_tokens.weight"], "output_norm.weight": hf["model.norm.weight"]}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.n_layer):
        for theirs, ours in names.items():
            w = hf[f"model.layers.{i}.{theirs}.weight"]
            if ours in ("attn_q", "attn_k"):
                w = interleave(w, cfg.n_head if ours == "attn_q" else Hkv)
            out[f"blk.{i}.{ours}.weight"] = w
    if "lm_head.weight" in hf:
        out["output.weight"] = hf["lm_head.weight"]         # absent: llama.cpp reads the embedding (tied)
    return out


def tensors(model: GPT) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of ``model``, float32, in NumPy order (see the module's Layout)."""
    cfg, p = model.config, {k: np.asarray(v, dtype=np.float32) for k, v in model.params.items()}
    arch = architecture(cfg)
    if arch == "llama":
        return _llama_tensors(cfg, p)
    C = cfg.d_model
    if p.get("lm_head.bias") is not None and np.any(p["lm_head.bias"]):
        raise TbpError("llama.cpp has no architecture that computes this model: its untied head has a bias "
                       "(tbp's untied head always does), and llama.cpp's gpt2 and gptneox heads have none; a model "
                       "with a tied head (the default) exports")

    def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
        return p[name + ".weight"], p.get(name + ".bias", np.zeros(C, np.float32))

    out = {"token_embd.weight": p["wte"]}
    if arch == "gpt2":
        out["position_embd.weight"] = p["wpe"]
    for i in range(cfg.n_layer):
        h, blk = f"h.{i}.", f"blk.{i}."
        n_qkv = p[h + "attn.c_attn.weight"].shape[1]
        parts = {"attn_norm": norm(h + "ln_1"), "attn_qkv": _linear(p, h + "attn.c_attn", n_qkv),
                 "attn_output": _linear(p, h + "attn.c_proj", C), "ffn_norm": norm(h + "ln_2"),
                 "ffn_up": _linear(p, h + "mlp.c_fc", 4 * C), "ffn_down": _linear(p, h + "mlp.c_proj", C)}
        for name, (w, b) in parts.items():
            out[blk + name + ".weight"], out[blk + name + ".bias"] = w, b
    out["output_norm.weight"], out["output_norm.bias"] = norm("ln_f")
    if "lm_head.weight" in p:
        out["output.weight"] = np.ascontiguousarray(p["lm_head.weight"].T)
    elif arch == "gptneox":                      # its head is never read from the embedding
        out["output.weight"] = p["wte"]
    return out


# --- the tokenizer ---------------------------------------------------------------------------
def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: bytes that print as themselves ("!".."~", "¡".."¬", "®".."ÿ")
    stand for themselves, the others in order for U+0100, U+0101, ... Checked against the
    tokenizers library's alphabet."""
    from tokenizers import pre_tokenizers
    own = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in own]
    table = {**{b: chr(b) for b in own}, **{b: chr(0x100 + n) for n, b in enumerate(rest)}}
    if sorted(table.values()) != sorted(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the byte-level alphabet differs from the tokenizers library's")
    return table


def _rwkv_escape(text: str) -> str:
    """A token's text as llama.cpp's rwkv vocabulary reads it (llama_unescape_rwkv_token)."""
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c in "\t\n\r":
            out.append({"\t": "\\t", "\n": "\\n", "\r": "\\r"}[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def vocabulary(tok: Tokenizer) -> dict:
    """The tokenizer keys of a GGUF file: model, pre, tokens, types, merges, special ids."""
    vocab = tok.hf.get_vocab()
    tokens = [None] * tok.vocab_size
    for s, i in vocab.items():
        tokens[i] = s
    specials = {t.content for t in tok.hf.get_added_tokens_decoder().values()}
    types = [3 if s in specials else 1 for s in tokens]       # 3: control, 1: normal
    eot = vocab.get(EOT)
    keys = {"types": types, "eos": eot, "eot": vocab.get(END), "template": None}
    if END in vocab and ASSISTANT in vocab:
        keys["template"] = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] "
                            "+ '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    elif IM_START in vocab and IM_END in vocab:             # ChatML's (an imported model's: data/chat.py)
        keys["eot"], keys["eos"] = vocab[IM_END], eot if eot is not None else vocab[IM_END]
        keys["template"] = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                            "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                            "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    if tok.kind == "bpe":
        spec = json.loads(tok.to_str())
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        return {**keys, "model": "gpt2", "pre": _pre(spec), "tokens": tokens, "merges": merges}
    if not specials:
        return {**keys, "model": "rwkv", "pre": None, "tokens": [_rwkv_escape(s) for s in tokens], "merges": None}
    table = _byte_symbols()
    merges, written = [], []
    for s in tokens:
        if s in specials:
            written.append(s)
            continue
        raw = s.encode("utf-8")
        if len(raw) > 2:
            raise TbpError(f"the char tokenizer has {s!r} (U+{ord(s):04X}), {len(raw)} bytes in UTF-8: llama.cpp's "
                           f"byte-level tokenizer would need tokens for its parts, which this model does not have")
        symbols = [table[b] for b in raw]
        if len(symbols) == 2:
            merges.append(" ".join(symbols))
        written.append("".join(symbols))
    return {**keys, "model": "gpt2", "pre": "gpt-2", "tokens": written, "merges": merges}


def _pre(spec: dict) -> str:
    """llama.cpp's pre-tokenizer for a byte-level BPE's tokenizer.json: "gpt-2" for GPT-2's
    (tbp's own BPE), "smollm" for SmolLM's (each digit apart, then GPT-2's); TbpError for any
    other, which llama.cpp would cut differently from tbp -- a file that loads and computes
    something else is never written."""
    def gpt2(step: dict) -> bool:           # GPT-2's byte-level step, its regex included
        return step.get("type") == "ByteLevel" and step.get("use_regex", True)
    pre = spec.get("pre_tokenizer") or {}
    if gpt2(pre):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and len(steps) == 2 and steps[0].get("type") == "Digits" \
            and steps[0].get("individual_digits") and gpt2(steps[1]):
        return "smollm"
    if (spec.get("model") or {}).get("byte_fallback"):
        why = "a byte-fallback BPE (Llama 2's, TinyLlama's) is llama.cpp's llama tokenizer model, which tbp does not write"
    else:
        why = f"its pre-tokenizer ({json.dumps(pre)[:80]}) is not GPT-2's or SmolLM's"
    raise TbpError(f"llama.cpp would cut text differently from this tokenizer: {why}")


# --- the file --------------------------------------------------------------------------------
def _gguf():
    try:
        import gguf
    except ImportError:
        raise TbpError("GGUF export needs the gguf package: pip install 'tbp[gguf]'") from None
    return gguf


def is_tbp_gguf(path: Path) -> bool:
    """True if ``path`` is a GGUF file tbp wrote (its metadata has MARK)."""
    gguf = _gguf()
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        return MARK in gguf.GGUFReader(path).fields
    except (OSError, ValueError, IndexError, KeyError):
        return False


def claim(out: Path, force: bool, inputs: tuple = ()) -> None:
    """--out of a GGUF export: a new file, or with --force a GGUF file tbp wrote."""
    out = Path(out)
    refuse_inputs(out, inputs, "file")
    if out.suffix != ".gguf":
        raise TbpError(f"{out}: a GGUF export's --out is a file ending in .gguf")
    if os.path.lexists(out):
        if not force:
            raise TbpError(f"{out} already exists (use --force to replace it)")
        if not out.is_file() or out.is_symlink() or not is_tbp_gguf(out):
            raise TbpError(f"{out}: is not a GGUF file tbp wrote; refusing to replace it, even with --force")


def _stored(gguf, a: np.ndarray, kind: str):
    """(array, raw dtype or None) as the file holds it: 1-D tensors (norms, biases) stay f32;
    matrices become f16, or q8_0 where their rows split into blocks of 32 (else f16, as llama.cpp's
    own converter does)."""
    if kind == "f32" or a.ndim == 1:
        return np.ascontiguousarray(a, dtype=np.float32), None
    if kind == "q8_0" and a.shape[-1] % Q8_BLOCK == 0:
        q = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), q), q
    return a.astype(np.float16), None


def export_gguf(model: GPT, tok: Tokenizer, out: Path, kind: str = "f32", name: str = "tbp",
                force: bool = False, inputs: tuple = ()) -> dict:
    """Write ``model`` and ``tok`` as one GGUF file at ``out`` (atomic: a temporary file in the
    same folder, renamed when complete). Returns a summary (architecture, tokenizer model, bytes)."""
    gguf = _gguf()
    if kind not in TYPES:
        raise ValueError(f"kind must be one of {TYPES}, got {kind!r}")
    if any("lora_" in k for k in model.params):
        raise TbpError("this is a LoRA run: fold it first with tbp merge, then export the merged run")
    out = Path(out)
    claim(out, force, inputs)
    cfg = model.config
    arch = architecture(cfg)
    arrays = tensors(model)
    voc = vocabulary(tok)
    from ..version import __version__
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(name)
        w.add_string(MARK, __version__)
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(cfg.n_ctx)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(build.attention_class(cfg).key_value_heads(cfg))
        if arch == "llama":
            w.add_feed_forward_length(arrays["blk.0.ffn_gate.weight"].shape[0])
            w.add_layer_norm_rms_eps(cfg.ln_eps)
        else:
            w.add_feed_forward_length(4 * cfg.d_model)
            w.add_layer_norm_eps(cfg.ln_eps)
        if arch != "gpt2":                                           # both rotate queries and keys
            w.add_rope_dimension_count(cfg.d_qk)
            w.add_rope_freq_base(parts(cfg, np.float32).positions.base)      # the rotation's base
        if arch == "gptneox":
            w.add_parallel_residual(False)
        w.add_tokenizer_model(voc["model"])
        if voc["pre"]:
            w.add_tokenizer_pre(voc["pre"])
        w.add_token_list(voc["tokens"])
        w.add_token_types(voc["types"])
        if voc["merges"] is not None:
            w.add_token_merges(voc["merges"])
        if voc["eos"] is not None:
            w.add_bos_token_id(voc["eos"])
            w.add_eos_token_id(voc["eos"])
        w.add_add_bos_token(False)
        if voc["template"]:
            w.add_eot_token_id(voc["eot"])
            w.add_chat_template(voc["template"])
        for tname, a in arrays.items():
            data, raw = _stored(gguf, a, kind)
            w.add_tensor(tname, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return {"architecture": arch, "tokenizer": voc["model"], "type": kind, "bytes": out.stat().st_size,
            "tensors": len(arrays)}

