"""Memory estimates made before anything is allocated, and a clear refusal when they cannot fit.

A size inside every option's range can still be far beyond the machine (96 layers of width
16384), and a hand-edited config.json can ask for 100,000 layers. Building such a model would
allocate until the system kills the process; instead, the parameter count comes from
``GPT.shapes`` (no allocation) and the estimate is compared with the memory available now.
The estimates are deliberately rough (within a factor of about 1.5 of the measured peak):
they exist to refuse the impossible, not to predict the peak.
"""
from __future__ import annotations

import dataclasses

import os

import numpy as np

from ..errors import TbpError
from ..nn.config import ModelConfig
from ..nn import build
from ..nn.build import model_class
from .cores import available_cores

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


def train_parts(cfg: ModelConfig, tcfg) -> dict[str, int]:
    """The bytes of a training run under ``tcfg`` (a TrainConfig), by what holds them: the
    weights; their gradients, one buffer per worker (data_parallel's threads); AdamW's two
    moments; and the activations: the larger of what a step's backward keeps
    (:func:`step_activation_bytes`) and what the run's evaluations hold (they read batches of
    batch_size rows, one per worker at a time; never at the same time as a step)."""
    workers = min(tcfg.threads or available_cores(), tcfg.batch_size)      # as data_parallel chooses
    weights = model_bytes(cfg, tcfg.dtype)
    step = step_activation_bytes(cfg, tcfg)
    evaluating = eval_activation_bytes(cfg, tcfg.batch_size, workers, tcfg.dtype)
    return {"weights": weights, "gradients": weights * workers, "AdamW moments": 2 * weights,
            "activations": max(step, evaluating)}


def step_activation_bytes(cfg: ModelConfig, tcfg) -> int:
    """What a training step's backward keeps: per token and layer about 26 C numbers plus two
    rows of H x T attention scores and weights, plus the logits (made the probabilities, then the
    gradient, in place), plus what each active variant keeps beyond that (its declared
    ``activations``: flash and recomputation keep fewer, Multi-Token Attention and Attention
    Residuals more)."""
    L = cfg.n_layer
    blocks = L * _block_numbers(cfg) + sum(v.activations(cfg) for v in build.active(cfg) if v.activations is not None)
    if cfg.recompute:                  # recompute.py: one block's share at a time, and every block's input
        blocks = blocks // L + L * cfg.d_model
    per_token = blocks + _head_numbers(cfg)
    return tcfg.batch_size * cfg.n_ctx * per_token * np.dtype(tcfg.dtype).itemsize


def _block_numbers(cfg: ModelConfig) -> int:
    """Numbers a block keeps per token for its backward: about 26 C, plus two rows of H x T
    attention scores and weights."""
    return 26 * cfg.d_model + 2 * cfg.n_head * cfg.n_ctx


def _head_numbers(cfg: ModelConfig) -> int:
    """Per token: the logits, one (N, V) array made the probabilities in place (loss.py), and
    the final norm's few rows."""
    return cfg.vocab_size + 4 * cfg.d_model


def eval_activation_bytes(cfg: ModelConfig, rows: int, workers: int = 1, dtype=np.float32) -> int:
    """An evaluation's activations: each of ``workers`` reads a batch of ``rows`` sequences,
    through a forward that lets each block go as soon as it is done (GPT.forward's ``keep``):
    one block's numbers at a time, the residual stream, and the logits."""
    L = cfg.n_layer
    extra = sum(v.activations(cfg) for v in build.active(cfg) if v.activations is not None)
    # one block's share of what training keeps (flash keeps no score maps: its extra is negative),
    # and all of what a design keeps across blocks (Attention Residuals' sources: positive)
    one_block = max(0, L * _block_numbers(cfg) + extra) // L + max(extra, 0)
    # the logits twice: the array and the loss's one temporary of its size
    per_token = one_block + 2 * cfg.d_model + _head_numbers(cfg) + cfg.vocab_size
    return workers * rows * cfg.n_ctx * per_token * np.dtype(dtype).itemsize


RUNTIME = 128 << 20        # the interpreter, NumPy, the tokenizer library: measured 90-130 MiB resident


def eval_bytes(cfg: ModelConfig, rows: int, dtype=np.float32) -> int:
    """``tbp eval``'s memory: the weights and their gradient buffers (every model holds one per
    weight), one worker's evaluation at ``rows`` sequences and the runtime
    (benchmarks/reliability/eval_memory.py measures it against this)."""
    return 2 * model_bytes(cfg, dtype) + eval_activation_bytes(cfg, rows, 1, dtype) + RUNTIME


def train_bytes(cfg: ModelConfig, tcfg) -> int:
    """A training step's bytes: the sum of :func:`train_parts`."""
    return sum(train_parts(cfg, tcfg).values())


def check_train_fits(cfg: ModelConfig, tcfg, what: str) -> None:
    """Refuse a training step the memory available cannot hold, naming what takes the memory
    and the options that would make it fit."""
    parts = train_parts(cfg, tcfg)
    needed, free = sum(parts.values()), available_bytes()
    if free is None or needed <= free:
        return
    held = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items())
    fixed = needed - parts["activations"]
    ways = []
    if fixed < free:                       # the activations are what does not fit
        if not cfg.recompute and build.refusal(cfg, "recompute") is None:
            less = train_parts(dataclasses.replace(cfg, recompute=True), tcfg)["activations"]
            ways.append(f"--recompute (activations {less / GiB:.1f} GiB)")
        ways.append("a smaller --batch-size or --n-ctx")
    else:
        ways.append(f"a smaller model (the weights, their gradients and AdamW's moments alone need "
                    f"{fixed / GiB:.1f} GiB)")
    if parts["weights"] < free:
        ways.append("--lora-rank R (adapters only)")
    raise TbpError(f"{what} needs about {needed / GiB:.1f} GiB of memory ({held} GiB; batch {tcfg.batch_size} x "
                   f"context {cfg.n_ctx}) and this machine has {free / GiB:.1f} GiB available; try "
                   f"{', or '.join(ways)}")


STEP_WORK_LIMIT = 3 * 10 ** 10       # multiply-adds of one step's heaviest variant: about 10 s on 2 cores


def check_step_work(cfg: ModelConfig, batch_size: int) -> None:
    """Refuse a configuration whose step would run for minutes (a 64 x 255 MTA kernel at T 512):
    a step that long cannot stop in time when a scheduler sends SIGTERM."""
    for v in build.active(cfg):
        if v.step_work is None:
            continue
        work, what, remedy = v.step_work(cfg, batch_size)
        if work > STEP_WORK_LIMIT:
            raise TbpError(f"{what} makes {work:.1e} multiply-adds a step ({STEP_WORK_LIMIT:.0e} at most: minutes "
                           f"per step on a CPU); {remedy}")


def decoder_bytes(cfg: ModelConfig, batch: int = 1, dtype=np.float32) -> int:
    """An Inference beside the loaded weights: the folded copies of the matrices that read a layer
    norm and the transposed MLP projections (together about as much as the weights) and the KV
    cache."""
    return model_bytes(cfg, dtype) + build.kv_cache_bytes(cfg, batch, dtype)


def check_fits(needed: int, what: str) -> None:
    """Raise TbpError naming ``what`` when ``needed`` bytes exceed the memory available now."""
    free = available_bytes()
    if free is not None and needed > free:
        raise TbpError(f"{what} needs about {needed / GiB:.1f} GiB of memory and this machine has "
                       f"{free / GiB:.1f} GiB available; use a smaller model, batch or context")
