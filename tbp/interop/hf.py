"""Hugging Face GPT-2 folders in and out: tbp's names and layout are GPT-2's already.

A GPT-2 folder holds ``config.json`` (model_type "gpt2"), ``model.safetensors`` and
``tokenizer.json``. Tensor names are tbp's with ``.weight`` on the embeddings and a
``transformer.`` prefix (which older checkpoints leave out); linear weights are stored
(in, out) in both (GPT-2's Conv1D), so no tensor is transposed. Nothing here touches the
network: import reads a local folder.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np
from safetensors.numpy import save as st_save

from ..runs import commit, disk
from ..files import jsonio
from ..machine import memory
from ..errors import TbpError
from ..files.atomic import (atomic_write_bytes, atomic_write_json, atomic_write_text, claim_output, not_a_file,
                            require_files)
from ..nn.gpt import GPT
from ..nn.config import ModelConfig
from ..nn import build
from ..files.staging import staged_dir
from ..data.tokenizer import Tokenizer
from . import llama

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
WIDENED = ("float32", "float16")      # what an import reads as float32 exactly: a weight's dtype is never coerced
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", ".owner")
PREFIX = "transformer."


def hf_name(name: str) -> str:
    """tbp name -> Hugging Face GPT2LMHeadModel state-dict name."""
    if name in ("wte", "wpe"):
        name += ".weight"
    return PREFIX + name


def tbp_name(name: str) -> str | None:
    """Hugging Face name (with or without the prefix) -> tbp name; None for buffers to skip."""
    if name.startswith(PREFIX):
        name = name[len(PREFIX):]
    if name.endswith((".attn.bias", ".attn.masked_bias")):
        return None                # the causal-mask buffers of older checkpoints
    if name in ("wte.weight", "wpe.weight"):
        return name[:-len(".weight")]
    return name


def exportable(cfg: ModelConfig) -> None:
    """Raise TbpError naming what GPT-2 cannot represent: each active variant that refuses
    export, with its reason (nn/variant.py); every other option whose declaration names the
    value GPT-2 uses (``option(..., gpt2=...)``) and differs from it; and a query/key width
    other than the value width."""
    problems = []
    if cfg.d_qk != cfg.d_v:
        problems.append(f"query/key width {cfg.d_qk} != value width {cfg.d_v} per head")
    refusing = {v.axis: v for v in reversed(build.active(cfg)) if "export" in v.refuses}
    for f in fields(cfg):
        need = f.metadata.get("gpt2")
        if need is not None and getattr(cfg, f.name) != need:
            why = refusing.pop(f.name).refuses["export"] if f.name in refusing else None
            problems.append(f"{f.name} = {getattr(cfg, f.name)} (GPT-2 has {need})" + (f": {why}" if why else ""))
    problems += [f"{v.name}: {v.refuses['export']}" for v in refusing.values()]
    if problems:
        raise TbpError("GPT-2 cannot represent this model: " + "; ".join(problems))


def hf_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    eot = tok.eot_id          # None for a char tokenizer: it has no end-of-text token
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size, "n_positions": cfg.n_ctx, "n_ctx": cfg.n_ctx,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.ln_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }


def claim_export_output(out: Path, force: bool, inputs: tuple = ()) -> None:
    """--out of an export: new, or --force over an earlier export that is not an input."""
    claim_output(out, force, EXPORT_FILES, "config.json", "a GPT-2 export", inputs)


def export_hf(model: GPT, tok: Tokenizer, out: Path, force: bool = False, inputs: tuple = ()) -> dict:
    exportable(model.config)
    claim_export_output(out, force, inputs)
    if any("lora_" in k for k in model.params):
        raise TbpError("this is a LoRA run: fold it first with tbp merge, then export the merged run")
    arrays = {hf_name(k): np.ascontiguousarray(v, dtype=np.float32) for k, v in model.params.items()}
    config = hf_config(model.config, tok)
    with staged_dir(out, force) as tmp:
        atomic_write_bytes(tmp / "model.safetensors", st_save(arrays, metadata={"format": "pt"}))
        atomic_write_json(tmp / "config.json", config)
        atomic_write_text(tmp / "tokenizer.json", tok.to_str())
        eot = "<|endoftext|>" if tok.eot_id is not None else None
        atomic_write_json(tmp / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.n_ctx,
            **({"bos_token": eot, "eos_token": eot, "unk_token": eot} if eot else {})})
    return config


def _config_from_hf(d: dict, path: Path) -> ModelConfig:
    if d.get("model_type") != "gpt2":
        raise TbpError(f"{path}: model_type is {d.get('model_type')!r}; tbp imports gpt2 and "
                       f"{', '.join(llama.MODEL_TYPES)} folders")
    missing = [k for k in ("n_embd", "n_layer", "n_head", "vocab_size") if k not in d]
    if missing or ("n_positions" not in d and "n_ctx" not in d):
        raise TbpError(f"{path}: missing GPT-2 config key {(missing or ['n_positions'])[0]!r}")
    # the values as they are: ModelConfig refuses true, 32.7 or "2" where an integer belongs
    C, L, H, V = d["n_embd"], d["n_layer"], d["n_head"], d["vocab_size"]
    n_ctx = d.get("n_positions", d.get("n_ctx"))
    act = d.get("activation_function", "gelu_new")
    if act not in TANH_GELUS + ("relu",):
        raise TbpError(f"{path}: activation_function {act!r} is not supported "
                       f"(tbp computes {', '.join(TANH_GELUS)} and relu)")
    if d.get("n_inner") is not None and (not isinstance(C, int) or d["n_inner"] != 4 * C):
        raise TbpError(f"{path}: n_inner {d['n_inner']} != 4 * n_embd; tbp's MLP expands by 4")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if d.get(flag):
            raise TbpError(f"{path}: {flag} is not supported")
    if d.get("scale_attn_weights") is False:
        raise TbpError(f"{path}: scale_attn_weights false is not supported")
    try:
        return ModelConfig(vocab_size=V, n_ctx=n_ctx, n_layer=L, n_head=H, d_model=C,
                           activation="relu" if act == "relu" else "gelu",
                           ln_eps=d.get("layer_norm_epsilon", 1e-5), tie_head=True)
    except (TypeError, ValueError) as e:            # ConfigError: a file's value, so exit 1 naming it
        raise TbpError(f"{path}: bad GPT-2 config ({e})") from None


def import_hf(src: Path, out: Path, force: bool = False) -> tuple[GPT, Tokenizer]:
    """Read a local GPT-2 folder into a tbp run directory; returns the loaded model.

    Every shape is checked against the header of model.safetensors, and the model's size
    against the memory available, before anything is built."""
    src = Path(src)
    commit.claim_run_output(out, force, inputs=(src,))
    require_files(src, ("config.json", "model.safetensors", "tokenizer.json"), "a GPT-2 folder")
    cfg = _config_from_hf(jsonio.read_json(src / "config.json"), src / "config.json")
    tok = Tokenizer.load(src / "tokenizer.json")
    if tok.vocab_size != cfg.vocab_size:
        raise TbpError(f"{src}: tokenizer has {tok.vocab_size} tokens but config.json says vocab_size "
                       f"{cfg.vocab_size}")
    weights = src / "model.safetensors"
    header = disk.read_header(weights)
    want = GPT.shapes(cfg)
    named: dict[str, str] = {}
    for name, (shape, dtype) in header.items():
        t = tbp_name(name)
        if t is None:
            continue
        if dtype not in WIDENED:              # float16 widens exactly; anything else would be coerced
            raise TbpError(f"{weights}: {name} is {dtype}; GPT-2 weights are floating point (float32, "
                           f"or float16, widened exactly)")
        if t in named:                        # two tensors for one weight: neither is chosen silently
            raise TbpError(f"{weights}: {named[t]} and {name} are both GPT-2's {hf_name(t)}; keep one")
        named[t] = name
        if t in want and tuple(shape) != want[t]:
            raise TbpError(f"{weights}: {t} has shape {tuple(shape)}, but config.json implies {want[t]}")
    memory.check_fits(2 * memory.model_bytes(cfg), f"importing {src}")
    raw, _ = disk.read_arrays(src / "model.safetensors")
    arrays, lm_head = {}, None
    for name, a in raw.items():
        if name.endswith("lm_head.weight"):
            lm_head = a
            continue
        t = tbp_name(name)
        if t is not None:
            arrays[t] = a
    if lm_head is not None and "wte" in arrays and not np.array_equal(lm_head, arrays["wte"]):
        raise TbpError(f"{src}: lm_head.weight differs from wte: an untied head without bias "
                       f"is not a GPT-2 layout tbp represents")
    model = GPT(cfg, seed=0, dtype=np.float32)
    disk.load_into(model, {k: a.astype(np.float32, copy=False) for k, a in arrays.items()},
                         src / "model.safetensors")
    record = {"model": cfg.to_dict(), "train": None, "data": None, "lora": None, "base": None,
              "imported_from": str(src.resolve())}
    commit.save_plain(out, model, tok, record, force, inputs=(src,))
    return model, tok


def import_folder(src: Path, out: Path, force: bool = False) -> tuple[GPT, Tokenizer, str]:
    """A local Hugging Face folder into a tbp run, by its config.json's model_type: GPT-2, or a
    Llama-family model (llama.py). Returns the model, its tokenizer and the family's name."""
    path = Path(src) / "config.json"
    kind = jsonio.read_json(path).get("model_type") if not_a_file(path) is None else None
    if kind in llama.MODEL_TYPES:
        return (*llama.import_llama(src, out, force), "Llama")
    return (*import_hf(src, out, force), "GPT-2")


def export_folder(model: GPT, tok: Tokenizer, out: Path, force: bool = False, inputs: tuple = ()) -> str:
    """``model`` as the Hugging Face folder of its family: a Llama block's as LlamaForCausalLM,
    any other as GPT-2 (refused, with what each family lacks, where neither represents it).
    Returns the family's name."""
    if llama.is_llama(model.config):
        llama.export_llama(model, tok, out, force, inputs)
        return "Llama"
    try:
        exportable(model.config)
    except TbpError as e:
        raise TbpError(f"{e}; nor can a Llama folder: {'; '.join(llama.problems(model.config))}") from None
    export_hf(model, tok, out, force, inputs)
    return "GPT-2"
