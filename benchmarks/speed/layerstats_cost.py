"""What recording the per-layer statistics costs, against the training step it rides on.

One process, the two timed in turn for ``--rounds`` rounds (medians): a whole training step of
the default model (4 x 128, context 128, batch 12: forward, backward, clipping, AdamW), and the
statistics an evaluation adds (layerstats.py: each layer's gradient norm, the parameter copy
and update ratios, the input RMS forward on two rows). The statistics run once per evaluation,
so their share of training is their time over ``eval_interval`` steps. One record in
results/layerstats_cost.jsonl.

    python benchmarks/speed/layerstats_cost.py --rounds 7
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))
import records
from tbp import GPT, ModelConfig
from tbp.train.config import TrainConfig
from tbp.train.layerstats import LayerStats
from tbp.nn.batch import Batch
from tbp.train.optim import AdamW, clip_grads


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    cfg, tcfg = ModelConfig(vocab_size=103), TrainConfig()
    model = GPT(cfg, seed=0)
    opt = AdamW(model.layout)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (tcfg.batch_size, cfg.n_ctx + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def step():
        model.zero_grad()
        model.loss_and_backward(x, y)
        clip_grads(model.layout.grads, tcfg.grad_clip)
        opt.step(1e-4)

    def stats():
        s = LayerStats(model)
        s.gradients()
        s.before_update()
        opt.step(1e-4)                 # the step the ratios are of; its time is taken out below
        s.updates()
        s.stream(Batch(x, y))
        return s.record()["stats_ms"]

    step(), stats()                    # warm: the buffers, the BLAS
    step_ms, stats_ms = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        step()
        step_ms.append(1e3 * (time.perf_counter() - t0))
        stats_ms.append(stats())
    med_step, med_stats = statistics.median(step_ms), statistics.median(stats_ms)
    row = {"commit": records.commit(), "model": "4 x 128, context 128, batch 12", "rounds": args.rounds,
           "eval_interval": tcfg.eval_interval, "step_ms": med_step, "stats_ms": med_stats,
           "share_of_an_eval_step": med_stats / med_step,
           "share_of_training": med_stats / (med_step * tcfg.eval_interval)}
    records.append("layerstats_cost", row)
    print(row)


if __name__ == "__main__":
    main()
