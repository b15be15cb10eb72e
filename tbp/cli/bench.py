"""`tbp bench`: training and generation throughput on this machine."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import click

from ..check.bench import (bench_decode_strategy, bench_decoding, bench_generate, bench_precisions, bench_speculation,
                           bench_train, matmul_peak_gflops, memory_bandwidth_gbs, train_flops_per_token)
from ..machine.cores import machine
from ..nn.config import ModelConfig
from ..nn import build
from .common import console, fmt_count, kv_table, load_run, the_run
from .options import (USER_SOURCES, check_strategy, config_options, given, refuse_unused, strategy_name,
                      strategy_options)
from .speculation import speculation_options


@click.command()
@click.option("--vocab-size", type=click.IntRange(min=2), default=65, show_default=True,
              help="Vocabulary (65: tinyshakespeare's characters).")
@config_options(ModelConfig)
@click.option("--batch-size", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed training steps (after 3 warm-up steps); the median is reported.")
@click.option("--gen-tokens", type=click.IntRange(min=0), default=None,
              help="Tokens to generate at batch 1 (default: the whole context; 0 skips generation).")
@click.option("--no-kv-cache", is_flag=True, help="Time generation without the cache (the quadratic baseline).")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Training threads sharing each batch, as in tbp train (0: one per core).")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "both"]), default="both", show_default=True,
              help="The training products' precision, as tbp train's --precision; both: fp32 and bf16 steps "
                   "paired in one process (--iters of each, in up to 5 rounds whose order reverses).")
@strategy_options("time")
@click.option("--checkpoint", "run", type=click.Path(path_type=Path), default=None, metavar="RUN",
              help="Time a trained run's decoding from --prompt instead of a configuration's steps: plain, and with "
                   "--lookup or --draft speculatively too, paired in 5 rounds (acceptance and tokens per forward "
                   "reported). Training is not timed.")
@click.option("--prompt", default="", help="With --checkpoint: the text decoding continues (default: from "
                                           "<|endoftext|>).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="With --checkpoint: sampling temperature (0: greedy).")
@speculation_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bench(vocab_size, batch_size, iters, gen_tokens, no_kv_cache, threads, precision, as_json, run, prompt, temperature,
          strategy=None, speculation=None, **model_opts):
    """Time training steps and cached generation for one model configuration.

    Training: forward + handwritten backward + clipping + AdamW on random tokens, median of
    --iters steps. Generation: batch-1 sampling from a one-token prompt. Also reports the
    achieved GFLOP/s (from the model's FLOP count) and this machine's float32 matmul peak,
    and which library did the products: NumPy's BLAS, or MKL where the `mkl` extra is
    installed and measured faster for this model; for bf16, oneDNN (the `onednn` extra) or
    MKL, whichever measured faster (TBP_GEMM=numpy|mkl|onednn|auto pins it). By default fp32
    and bf16 training steps are timed paired, with the CPU's bf16 units.

    \b
    Examples:
      tbp bench --n-layer 4 --n-head 4 --d-model 128 --n-ctx 64 --batch-size 12
      tbp bench --n-ctx 1024 --iters 3 --json
      tbp bench --positions rope --n-ctx 8192 --iters 1 --gen-tokens 0 --sparse window --budget 512
      tbp bench --checkpoint checkpoints/pydoc --prompt "def add(a, b):" --lookup
    """
    ctx = click.get_current_context()
    if run is not None or speculation is not None:
        return bench_run(ctx, run, prompt, temperature, gen_tokens, speculation, strategy, as_json)
    refuse_unused(ctx, ("prompt", "temperature"), "--checkpoint")
    cfg = ModelConfig.from_dict({"vocab_size": vocab_size, **model_opts})
    why = build.refusal(cfg, "bench")
    if why is not None:
        raise click.UsageError(why)
    if strategy is not None:
        check_strategy(cfg, strategy)
        if cfg.n_ctx < 2 * strategy.budget:
            raise click.UsageError(f"--budget {strategy.budget}: a context of {cfg.n_ctx} leaves nothing to thin")
    res = {"config": {**cfg.to_dict(), "batch_size": batch_size}}
    with console.status("timing training steps...") if not as_json else contextlib.nullcontext():
        if precision == "both":
            rounds = min(5, iters)                 # --iters timed steps per precision, in up to 5 rounds
            paired = bench_precisions(cfg, batch_size, rounds=rounds, steps=-(-iters // rounds), threads=threads)
            fp32 = paired["fp32"]
            res.update({"train_ms_per_iter": fp32["ms_per_iter"], "train_tokens_per_s": fp32["tokens_per_s"],
                        "gflops": train_flops_per_token(cfg) * fp32["tokens_per_s"] / 1e9,
                        "train_iters": paired["precision_rounds"] * paired["precision_steps"],
                        "train_threads": paired["threads"], "train_gemm": fp32["gemm"], "train_gemm_reason": fp32["gemm_reason"],
                        "train_precision": "fp32", "precisions": paired})
        else:
            res.update(bench_train(cfg, batch_size, iters, threads=threads, precision=precision))
    if gen_tokens != 0:
        with console.status("timing generation...") if not as_json else contextlib.nullcontext():
            res.update(bench_generate(cfg, gen_tokens, use_cache=not no_kv_cache))
    else:
        res["generate_tokens_per_s"] = None
    if strategy is not None:
        name = strategy_name(strategy)
        with console.status(f"timing {name} against dense decoding...") if not as_json else contextlib.nullcontext():
            res.update(bench_decode_strategy(cfg, strategy, name))
    res["peak_gflops"] = matmul_peak_gflops()
    if res.get("generate_tokens_per_s"):
        res["memory_gbs"] = memory_bandwidth_gbs()
        res["generate_roofline_tokens_per_s"] = res["memory_gbs"] * 1e9 / res["generate_weight_bytes"]
    res["machine"] = machine()
    if as_json:
        click.echo(json.dumps(res))
        return
    attention = next((v.name for v in build.active(cfg) if v.axis == "attention"), "standard attention")
    t = kv_table(f"tbp bench: {cfg.n_layer}L · {cfg.n_head}H · d_model {cfg.d_model} · context {cfg.n_ctx} · "
                 f"batch {batch_size} · {attention} · {cfg.attn_kernel} kernel{' (auto)' * (cfg.attn_impl == 'auto')} · "
                 f"{cfg.positions} positions", "right")
    threads_used = f" · {res['train_threads']} thread(s)" if res["train_threads"] else ""
    if "precisions" in res:
        paired = res["precisions"]
        for p in ("fp32", "bf16"):
            t.add_row(f"train {p}", f"{paired[p]['ms_per_iter']:.1f} ms/step · "
                                    f"{fmt_count(paired[p]['tokens_per_s'])} tokens/s")
            t.add_row(f"{p} products", f"{paired[p]['gemm']}: {paired[p]['gemm_reason']}")
        t.add_row("bf16 / fp32", f"{paired['bf16_speedup']:.2f}× the speed (median of {paired['precision_rounds']} "
                                 f"paired rounds){threads_used}")
    else:
        t.add_row(f"train {res['train_precision']}", f"{res['train_ms_per_iter']:.1f} ms/step · "
                                                     f"{fmt_count(res['train_tokens_per_s'])} tokens/s{threads_used}")
        t.add_row("products", f"{res['train_gemm']}: {res['train_gemm_reason']}")
    t.add_row("achieved", f"{res['gflops']:.1f} GFLOP/s ({100 * res['gflops'] / res['peak_gflops']:.0f}% of "
                          f"the matmul peak {res['peak_gflops']:.0f} GFLOP/s)")
    if res.get("generate_tokens_per_s") and res["generate_weight_bytes"] >= 32 << 20:
        # below that the weights stay in the caches and Python's per-token work is the cost
        share = res["generate_tokens_per_s"] / res["generate_roofline_tokens_per_s"]
        t.add_row("memory", f"{res['memory_gbs']:.1f} GB/s read by one thread: with {res['generate_weight_bytes'] / 1e6:,.1f} MB "
                            f"of weights read a token, decoding's roofline is "
                            f"{res['generate_roofline_tokens_per_s']:,.0f} tokens/s; generation ran at {100 * share:.0f}% "
                            f"of it")
        t.add_row("generate", f"{res['generate_tokens_per_s']:.0f} tokens/s at batch 1 "
                              f"({res['generate_tokens']} tokens, {'no ' if no_kv_cache else ''}KV cache)")
    if strategy is not None:
        d, s = res["decode_dense_tokens_per_s"], res[f"decode_{name}_tokens_per_s"]
        t.add_row(f"{name} decode", f"{strategy.describe()}, at a cache of {res['decode_cache']:,}: "
                                    f"{s:.0f} tokens/s against dense {d:.0f} "
                                    f"({res[f'decode_{name}_speedup']:.2f}×, paired round by round)")
    m = res["machine"]
    t.add_row("machine", f"{m['cpu']} · {m['cores']} core(s) · SIMD {m['simd']} · BLAS {m['blas']}"
                         + (f" ({m['blas_threads']} thread(s))" if m["blas_threads"] else "")
                         + f" · bf16 units: {m['bf16_units'] or 'none reported'}")
    console.print(t)


def bench_run(ctx, run, prompt: str, temperature: float, gen_tokens, speculation, strategy, as_json: bool) -> None:
    """`tbp bench --checkpoint RUN`: the run's batch-1 decoding from ``prompt``, plain, and
    speculative where asked, paired (check.bench.bench_speculation)."""
    if run is None:
        raise click.UsageError(f"{'--lookup' if speculation.lookup else '--draft'} drafts for a trained model's "
                               f"text: give the run with --checkpoint")
    if strategy is not None:
        raise click.UsageError(f"--checkpoint times plain and speculative decoding; a decoding strategy "
                               f"({strategy_name(strategy)}) is timed on a configuration (leave --checkpoint out)")
    set_here = sorted({*given(ctx, ModelConfig), *(n for n in ("vocab_size", "batch_size", "iters", "threads",
                                                               "precision", "no_kv_cache")
                                                   if ctx.get_parameter_source(n) in USER_SOURCES)})
    if set_here:
        raise click.UsageError(f"--{set_here[0].replace('_', '-')} shapes or trains a configuration; with --checkpoint "
                               f"the run's own model is timed, and training is not")
    if gen_tokens == 0:
        raise click.UsageError("--gen-tokens 0 leaves nothing to time with --checkpoint")
    from ..generate.sampling import Sampling
    from .generate import start_tokens
    run = the_run(run)
    model, tok, _ = load_run(run)
    ids, _ = start_tokens(tok, prompt, model.config.n_ctx)
    ids = ids[-model.config.n_ctx:]
    new = gen_tokens or 128
    sampling = Sampling(temperature, banned=tuple(i for i in (tok.sep_id, tok.pad_id) if i is not None))
    status = console.status("timing decoding...") if not as_json else contextlib.nullcontext()
    with status:
        if speculation is not None:
            res = bench_speculation(model, ids, new, speculation.drafter(model, tok, run), sampling)
        else:
            res = bench_decoding(model, ids, new, sampling)
    res.update({"checkpoint": str(run), "prompt_tokens": len(ids), "temperature": temperature, "machine": machine()})
    if as_json:
        click.echo(json.dumps(res))
        return
    cfg = model.config
    t = kv_table(f"tbp bench: decoding {run} ({cfg.n_layer} × {cfg.d_model})")
    t.add_row("prompt", f"{len(ids)} tokens, then {new} new at temperature {temperature:g}, batch 1")
    t.add_row("plain", f"{res['plain_tokens_per_s']:.0f} tokens/s")
    if speculation is not None:
        t.add_row("speculative", f"{res['speculative_tokens_per_s']:.0f} tokens/s · {res['speculative_speedup']:.2f}× "
                                 f"plain (median of {res['speculation_rounds']} paired rounds) · {res['speculation']}")
        kept = "none drafted" if res["acceptance"] is None else f"{res['acceptance']:.0%} of {res['drafted']:,} kept"
        t.add_row("drafts", f"{kept} · {res['tokens_per_forward']:.2f} tokens a forward of the model · "
                            f"text {'the same as' if res['same_text'] else 'NOT the same as'} plain decoding's")
    m = res["machine"]
    t.add_row("machine", f"{m['cpu']} · {m['cores']} core(s) · SIMD {m['simd']} · BLAS {m['blas']}")
    console.print(t)
