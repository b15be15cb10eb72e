"""Memory estimates made before anything is allocated, and a clear refusal when they cannot fit.

A size inside every option's range can still be far beyond the machine (96 layers of width
16384), and a hand-edited config.json can ask for 100,000 layers. Building such a model would
allocate until the system kills the process; instead, the parameter count comes from
``GPT.shapes`` (no allocation) and the estimate is compared with the memory available now.
The estimates are deliberately rough (within a factor of about 1.5 of the measured peak):
they exist to refuse the impossible, not to predict the peak.
"""
from __future__ import annotations

import os

import numpy as np

from .errors import TbpError
from .nn import ModelConfig, model_class
from .nn.decode import kv_cache_bytes
from .nn.flash import BLOCK_K as FLASH_BLOCK
from .parallel import available_cores

GiB = 1 << 30


def available_bytes() -> int | None:
    """Memory the system can give this process now (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parameter_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for s in model_class(cfg).shapes(cfg).values())


def model_bytes(cfg: ModelConfig, dtype=np.float32) -> int:
    """The weights alone."""
    return parameter_count(cfg) * np.dtype(dtype).itemsize


def train_bytes(cfg: ModelConfig, tcfg) -> int:
    """A training step under ``tcfg`` (a TrainConfig): weights, gradients and two moments (4x
    the weights), one gradient buffer per extra worker, and the activations the backward keeps:
    per token and layer about 26 C numbers plus a row of H x T attention weights (flash keeps
    none: one log-sum-exp per head, and one block of scores at a time), plus the logits and
    their softmax (and with Attention Residuals, two C-vectors per sublayer)."""
    C, T, H, V = cfg.d_model, cfg.n_ctx, cfg.n_head, cfg.vocab_size
    L = cfg.n_layer + (cfg.n_enc_layer or 0) * 2        # an encoder layer, and a decoder's cross-attention
    maps = 2 if cfg.attention == "standard" else 6       # MTA keeps S0, Z, A, A', A'' per head
    weights = 2 * H if cfg.attn_kernel == "flash" else maps * H * T
    per_token = L * (26 * C + weights) + 3 * V + 4 * C
    if cfg.attn_kernel == "flash":                       # a block's scores and probabilities, per row
        per_token += 2 * H * FLASH_BLOCK
    if cfg.residual == "attention":                      # partial sums, and each source's gradient
        per_token += 2 * (2 * cfg.n_layer + 1) * C
    activations = tcfg.batch_size * T * per_token
    workers = min(tcfg.threads or available_cores(), tcfg.batch_size)      # as data_parallel chooses
    return (model_bytes(cfg, tcfg.dtype) * (4 + workers - 1)
            + activations * np.dtype(tcfg.dtype).itemsize)


MTA_WORK_LIMIT = 3 * 10 ** 10        # multiply-adds of the convolutions in one step: about 10 s on 2 cores


def mta_step_work(cfg: ModelConfig, batch_size: int) -> int:
    """Multiply-adds of Multi-Token Attention's key-query convolutions in one training step:
    each of cq x ck taps passes over every B x H x T x T score map once forward and twice
    backward (dX and the kernel's gradient), in each convolution layer (twice with mta_post)."""
    if cfg.attention != "mta":
        return 0
    taps = cfg.mta_cq * cfg.mta_ck
    maps = batch_size * cfg.n_head * cfg.n_ctx ** 2 * len(cfg.mta_conv_layers()) * (2 if cfg.mta_post else 1)
    return 3 * taps * maps


def check_step_work(cfg: ModelConfig, batch_size: int) -> None:
    """Refuse a configuration whose step would run for minutes (a 64 x 255 MTA kernel at T 512):
    a step that long cannot stop in time when a scheduler sends SIGTERM."""
    work = mta_step_work(cfg, batch_size)
    if work > MTA_WORK_LIMIT:
        raise TbpError(f"an MTA kernel of {cfg.mta_cq} x {cfg.mta_ck} over {cfg.n_ctx} x {cfg.n_ctx} maps makes "
                       f"{work:.1e} multiply-adds a step ({MTA_WORK_LIMIT:.0e} at most: minutes per step on a "
                       f"CPU); use a smaller kernel (the paper's is 6 x 11), context or batch")


def decoder_bytes(cfg: ModelConfig, batch: int = 1, dtype=np.float32) -> int:
    """A Decoder beside the loaded weights: the folded copies of the matrices that read a layer
    norm (about as much as the weights) and the KV cache."""
    return model_bytes(cfg, dtype) + kv_cache_bytes(cfg, batch, dtype)


def check_fits(needed: int, what: str) -> None:
    """Raise TbpError naming ``what`` when ``needed`` bytes exceed the memory available now."""
    free = available_bytes()
    if free is not None and needed > free:
        raise TbpError(f"{what} needs about {needed / GiB:.1f} GiB of memory and this machine has "
                       f"{free / GiB:.1f} GiB available; use a smaller model, batch or context")
