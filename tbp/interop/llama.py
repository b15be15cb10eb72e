"""Hugging Face Llama-family folders in and out (``LlamaForCausalLM``: SmolLM2, TinyLlama,
Llama 3.2 and the many models that share the architecture).

A Llama block is tbp's pre-norm block with four choices made: RMSNorm (``norm = rms``), a
SwiGLU MLP, rotary positions in the rotate-half convention (pair i is channels i and i + D/2,
as tbp's rotation pairs them), grouped-query attention where the folder has fewer key/value
heads than query heads; no biases anywhere, and a head tied to the embedding or untied without
a bias. What differs is the layout of the weights, mapped here and nowhere else:

    model.embed_tokens.weight (V, C)                       -> wte (V, C)
    layers.i.input_layernorm / post_attention_layernorm    -> h.i.ln_1 / h.i.ln_2
    layers.i.self_attn.{q,k,v}_proj.weight (out, C)        -> h.i.attn.c_attn.weight (C, [q | k | v])
    layers.i.self_attn.o_proj.weight (C, H D)              -> h.i.attn.c_proj.weight (H D, C)
    layers.i.mlp.{gate,up}_proj.weight (F, C)              -> h.i.mlp.c_fc.weight (C, [gate | up])
    layers.i.mlp.down_proj.weight (C, F)                   -> h.i.mlp.c_proj.weight (F, C)
    model.norm.weight                                      -> ln_f.weight
    lm_head.weight (V, C), absent when tied                -> lm_head.weight (C, V)

PyTorch stores a linear layer's weight (out, in); tbp stores (in, out): every matrix is
transposed once. Weights stored in bfloat16 (most published checkpoints) or float16 widen to
float32 exactly. Nothing here touches the network: import reads a local folder. What the
engine cannot compute as the folder means it (rope scaling, a sliding window, biases on some
projections only, another activation) is refused with the reason, before anything is written.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

from ..data.tokenizer import Tokenizer
from ..errors import TbpError
from ..files import jsonio
from ..files.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text, claim_output, require_files
from ..files.staging import staged_dir
from ..machine import memory
from ..nn.config import N_CTX_MAX, ModelConfig
from ..nn.gpt import GPT
from ..runs import commit, disk

MODEL_TYPES = ("llama",)
FILES = ("config.json", "model.safetensors", "tokenizer.json")
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", ".owner")
# the choices that make a tbp model a Llama block (ModelConfig's flat names); the rest of a
# config (widths, heads, eps, base, head) is read from the folder
FAMILY = {"arch": "gpt", "norm": "rms", "mlp": "swiglu", "positions": "rope", "bias": False, "head_bias": False}
SCALING = "tbp's rotary positions have no frequency scaling (Llama 3.1's, YaRN, linear, dynamic)"
WIDEN = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}      # safetensors dtypes read as float32 exactly


# --- config.json ----------------------------------------------------------------------------------
def config_from_llama(d: dict, path: Path) -> ModelConfig:
    """A ModelConfig from a Llama config.json, or TbpError naming the key and why."""
    if not isinstance(d, dict) or d.get("model_type") not in MODEL_TYPES:
        got = d.get("model_type") if isinstance(d, dict) else None
        raise TbpError(f"{path}: model_type is {got!r}, not one of {', '.join(MODEL_TYPES)}")
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    missing = [k for k in keys if k not in d]
    if missing:
        raise TbpError(f"{path}: missing Llama config key {missing[0]!r}")
    refused = {
        "hidden_act": (d.get("hidden_act", "silu") != "silu", "tbp's SwiGLU gates with silu"),
        "rope_scaling": (d.get("rope_scaling") is not None, SCALING),
        "rope_parameters": (not isinstance(d.get("rope_parameters") or {}, dict)
                            or (d.get("rope_parameters") or {}).get("rope_type", "default") != "default", SCALING),
        "attention_bias": (bool(d.get("attention_bias")), "a Llama block here has no biases"),
        "mlp_bias": (bool(d.get("mlp_bias")), "a Llama block here has no biases"),
        "sliding_window": (d.get("sliding_window") is not None and d.get("use_sliding_window", True),
                           "tbp's attention reads the whole context"),
        "pretraining_tp": (d.get("pretraining_tp", 1) not in (1, None), "the tensor-parallel split of the "
                                                                         "projections is not computed"),
    }
    for key, (bad, why) in refused.items():
        if bad:
            raise TbpError(f"{path}: {key} {d.get(key)!r} is not supported: {why}")
    C, H = d["hidden_size"], d["num_attention_heads"]
    Hkv = d.get("num_key_value_heads") or H
    if isinstance(C, int) and isinstance(H, int) and H > 0 and d.get("head_dim") not in (None, C // H):
        raise TbpError(f"{path}: head_dim {d['head_dim']} != hidden_size / num_attention_heads ({C // H}); "
                       f"tbp's heads split the width")
    # rope theta: at the top (transformers 4) or in rope_parameters (transformers 5); Llama's default
    theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))
    n_ctx = d.get("max_position_embeddings", 2048)
    if isinstance(n_ctx, int) and n_ctx > N_CTX_MAX:
        n_ctx = N_CTX_MAX        # rotary positions slide past it: only the KV cache's length is bounded
    values = dict(FAMILY, vocab_size=d["vocab_size"], n_ctx=n_ctx, n_layer=d["num_hidden_layers"], n_head=H,
                  d_model=C, ln_eps=d.get("rms_norm_eps", 1e-6), tie_head=d.get("tie_word_embeddings", False),
                  attention="gqa" if Hkv != H else "standard", rope_base=theta,
                  swiglu_hidden=d["intermediate_size"], **({"n_kv_head": Hkv} if Hkv != H else {}))
    try:
        return ModelConfig.from_dict(values)
    except (TypeError, ValueError) as e:            # ConfigError: a file's value, so exit 1 naming it
        raise TbpError(f"{path}: bad Llama config ({e})") from None


def problems(cfg: ModelConfig) -> list[str]:
    """What keeps a tbp model from being a Llama block, one phrase each ([] when it is one)."""
    flat = cfg.flat()
    out = [f"{k} = {flat[k]} (a Llama block has {v})" for k, v in FAMILY.items()
           if flat[k] != v and not (k == "head_bias" and cfg.tie_head)]
    if cfg.attention not in ("standard", "gqa"):
        out.append(f"attention = {cfg.attention} (a Llama block has standard or grouped-query attention)")
    if cfg.d_qk != cfg.d_v:
        out.append(f"query/key width {cfg.d_qk} != value width {cfg.d_v} per head")
    if cfg.residual != "sum":
        out.append(f"residual = {cfg.residual} (a Llama block sums into its residual stream)")
    if not cfg.causal:
        out.append("non-causal attention")
    return out


def is_llama(cfg: ModelConfig) -> bool:
    return not problems(cfg)


def llama_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    """The config.json of a LlamaForCausalLM equal to a model of ``cfg``."""
    flat = cfg.flat()
    eot = tok.eot_id
    F, Hkv = _widths(cfg)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": F,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": Hkv, "head_dim": cfg.d_v, "hidden_act": "silu",
        "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.ln_eps, "rope_theta": flat["rope_base"],
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_head, "initializer_range": 0.02, "use_cache": True,
        "attention_dropout": 0.0, "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }


def _widths(cfg: ModelConfig) -> tuple[int, int]:
    """(F, Hkv): the MLP's width and the key/value heads, from the weights' shapes (c_proj is
    (F, C); c_attn is (C, H D + 2 Hkv D) under grouped-query or standard attention alike)."""
    shapes = GPT.shapes(cfg)
    H, D = cfg.n_head, cfg.d_v
    return shapes["h.0.mlp.c_proj.weight"][0], (shapes["h.0.attn.c_attn.weight"][1] - H * D) // (2 * D)


# --- weights ------------------------------------------------------------------------------------------
def to_tbp(raw: dict[str, np.ndarray], cfg: ModelConfig, source: Path) -> dict[str, np.ndarray]:
    """Hugging Face Llama tensors -> tbp's names and layout (the table above)."""
    def take(name: str) -> np.ndarray:
        a = raw.pop(name, None)
        if a is None:
            raise TbpError(f"{source}: missing tensor {name!r}")
        return a
    out = {"wte": take("model.embed_tokens.weight"), "ln_f.weight": take("model.norm.weight")}
    for i in range(cfg.n_layer):
        p, h = f"model.layers.{i}.", f"h.{i}."
        out[h + "ln_1.weight"] = take(p + "input_layernorm.weight")
        out[h + "ln_2.weight"] = take(p + "post_attention_layernorm.weight")
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        out[h + "attn.c_attn.weight"] = np.concatenate([q.T, k.T, v.T], axis=1)
        out[h + "attn.c_proj.weight"] = take(p + "self_attn.o_proj.weight").T
        gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
        out[h + "mlp.c_fc.weight"] = np.concatenate([gate.T, up.T], axis=1)
        out[h + "mlp.c_proj.weight"] = take(p + "mlp.down_proj.weight").T
    head = raw.pop("lm_head.weight", None)
    if not cfg.tie_head:
        if head is None:
            raise TbpError(f"{source}: tie_word_embeddings is false but there is no lm_head.weight")
        out["lm_head.weight"] = head.T
    elif head is not None and not np.array_equal(head, out["wte"]):
        raise TbpError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
    raw.pop("model.rotary_emb.inv_freq", None)
    for i in range(cfg.n_layer):
        raw.pop(f"model.layers.{i}.self_attn.rotary_emb.inv_freq", None)    # older files keep the buffer
    if raw:
        raise TbpError(f"{source}: {len(raw)} tensor(s) a Llama model of this config.json does not have, "
                       f"first {next(iter(raw))!r}")
    return {k: np.ascontiguousarray(a) for k, a in out.items()}


def to_hf(params: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """tbp's parameters -> Hugging Face Llama tensors (the inverse of :func:`to_tbp`)."""
    H, D = cfg.n_head, cfg.d_v
    F, Hkv = _widths(cfg)
    c = lambda a: np.ascontiguousarray(a, dtype=np.float32)
    out = {"model.embed_tokens.weight": c(params["wte"]), "model.norm.weight": c(params["ln_f.weight"])}
    for i in range(cfg.n_layer):
        p, h = f"model.layers.{i}.", f"h.{i}."
        out[p + "input_layernorm.weight"] = c(params[h + "ln_1.weight"])
        out[p + "post_attention_layernorm.weight"] = c(params[h + "ln_2.weight"])
        qkv = params[h + "attn.c_attn.weight"]
        q, k, v = np.split(qkv, [H * D, H * D + Hkv * D], axis=1)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = c(q.T), c(k.T)
        out[p + "self_attn.v_proj.weight"] = c(v.T)
        out[p + "self_attn.o_proj.weight"] = c(params[h + "attn.c_proj.weight"].T)
        fc = params[h + "mlp.c_fc.weight"]
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = c(fc[:, :F].T), c(fc[:, F:].T)
        out[p + "mlp.down_proj.weight"] = c(params[h + "mlp.c_proj.weight"].T)
    if not cfg.tie_head:
        out["lm_head.weight"] = c(params["lm_head.weight"].T)
    return out


def read_widened(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32: float32 as stored, float16 and bfloat16
    widened exactly (a bfloat16 is the top 16 bits of a float32). Anything else is refused,
    naming the tensor. The header is checked by the safetensors library first."""
    header = disk.read_header(path)
    for name, (_, dtype) in header.items():
        if dtype not in ("float32", "float16", "bfloat16"):
            raise TbpError(f"{path}: {name} is {dtype}; Llama weights are float32, float16 or bfloat16")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = jsonio.parse(f.read(n).decode("utf-8"), str(path))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = np.frombuffer(data[start:end], dtype=WIDEN[info["dtype"]])
        if info["dtype"] == "BF16":
            a = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            a = raw.astype(np.float32)
        out[name] = a.reshape(info["shape"])
    return out


# --- in and out -----------------------------------------------------------------------------------------
def import_llama(src: Path, out: Path, force: bool = False) -> tuple[GPT, Tokenizer]:
    """Read a local Llama-family folder into a tbp run directory; returns the loaded model.
    The config and the tokenizer are checked, and the model's size against the memory
    available, before the weights are read."""
    src = Path(src)
    commit.claim_run_output(out, force, inputs=(src,))
    if not (src / "model.safetensors").exists() and (src / "model.safetensors.index.json").is_file():
        raise TbpError(f"{src}: the weights are split into shards (model.safetensors.index.json); tbp reads "
                       f"one model.safetensors")
    require_files(src, FILES, "a Llama folder")
    cfg = config_from_llama(jsonio.read_json(src / "config.json"), src / "config.json")
    tok = Tokenizer.load(src / "tokenizer.json")
    if tok.vocab_size != cfg.vocab_size:
        raise TbpError(f"{src}: tokenizer.json has {tok.vocab_size} tokens but config.json says vocab_size "
                       f"{cfg.vocab_size}")
    memory.check_fits(3 * memory.model_bytes(cfg), f"importing {src}")
    weights = src / "model.safetensors"
    arrays = to_tbp(read_widened(weights), cfg, weights)
    model = GPT(cfg, seed=0, dtype=np.float32)
    disk.load_into(model, arrays, weights)
    record = {"model": cfg.to_dict(), "train": None, "data": None, "lora": None, "base": None,
              "imported_from": str(src.resolve())}
    commit.save_plain(out, model, tok, record, force, inputs=(src,))
    return model, tok


def claim_export_output(out: Path, force: bool, inputs: tuple = ()) -> None:
    claim_output(out, force, EXPORT_FILES, "config.json", "a Llama export", inputs)


def export_llama(model: GPT, tok: Tokenizer, out: Path, force: bool = False, inputs: tuple = ()) -> dict:
    """Write ``model`` as a Hugging Face LlamaForCausalLM folder (float32)."""
    wrong = problems(model.config)
    if wrong:
        raise TbpError("a Llama folder cannot represent this model: " + "; ".join(wrong))
    claim_export_output(out, force, inputs)
    if any("lora_" in k for k in model.params):
        raise TbpError("this is a LoRA run: fold it first with tbp merge, then export the merged run")
    config = llama_config(model.config, tok)
    with staged_dir(out, force) as tmp:
        atomic_write_bytes(tmp / "model.safetensors", st_save(to_hf(model.params, model.config),
                                                              metadata={"format": "pt"}))
        atomic_write_json(tmp / "config.json", config)
        atomic_write_text(tmp / "tokenizer.json", tok.to_str())
        eot = "<|endoftext|>" if tok.eot_id is not None else None
        atomic_write_json(tmp / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.n_ctx,
            **({"bos_token": eot, "eos_token": eot, "unk_token": eot} if eot else {})})
    return config
