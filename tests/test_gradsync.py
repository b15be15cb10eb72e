"""The parts of gradsync.py that one process can prove: that a block's gradient is final when the
backward reports it (what overlapping the sum with the backward relies on, for every model the
buckets cover), that a slice of AdamW updates its entries exactly as the whole does, and how the
layout is cut into shards and buckets. The MPI jobs themselves are in test_mpi.py."""
import numpy as np
import pytest

from tbp import GPT, ModelConfig
from tbp.train.gradsync import Buckets, shard_counts
from tbp.nn.lora import LORA_TARGETS, add_lora
from tbp.nn.batch import Batch
from tbp.train.optim import AdamW
from tbp.train.parallel import DataParallel, Serial

BASE = dict(vocab_size=13, n_ctx=8, n_layer=3, n_head=2, d_model=8)
MODELS = {
    "gpt": {},
    "attention-residuals": dict(residual="attention"),
    "block-attention-residuals": dict(residual="attention", residual_blocks=2),
    "mta": dict(attention="mta", mta_post=True, mta_mix=True, mta_norm=True, mta_depth_scale=True),
    "gqa-rope": dict(attention="gqa", n_head=4, n_kv_head=2, positions="rope"),
    "dropout": dict(dropout=0.2),
    "untied": dict(tie_head=False),
    "flash": dict(attn_impl="flash"),
}


class Recorder:
    """A stand-in for GradientSync: keeps a copy of each block's gradient when it is reported."""

    def __init__(self, model):
        self.buckets = Buckets.of(model)
        self.grads = model.layout.grads
        self.seen: dict[int, list[np.ndarray]] = {}
        self.order: list[int] = []

    def block_done(self, i):
        self.order.append(i)
        self.seen[i] = [self.grads[a:b].copy() for a, b in self.buckets.blocks[i]]

    def premature(self) -> list[int]:
        """The blocks whose gradient changed after it was reported."""
        return [i for i, parts in self.seen.items()
                if not all(np.array_equal(p, self.grads[a:b]) for p, (a, b) in zip(parts, self.buckets.blocks[i]))]


def _model(kind, lora=False):
    model = GPT(ModelConfig.from_dict(dict(**{**BASE, **MODELS[kind]})), seed=1, dtype=np.float64)
    if lora:
        add_lora(model, 2, 4.0, LORA_TARGETS[:4])
        for k, p in model.params.items():
            if k.endswith("lora_up"):
                p += 0.1
    return model


def _batch(model, B=5, seed=0):
    rng = np.random.default_rng(seed)
    out = Batch(rng.integers(0, 13, (B, 8)), rng.integers(0, 13, (B, 8)))
    if model.config.dropout:
        out = out.with_noise(rng.integers(0, 1 << 62, B))
    return out


def _workers(model, n):
    return Serial(model) if n == 1 else DataParallel(model, n)


def faults(model, workers) -> list[str]:
    """What is wrong with the blocks the backward reports, over a step of two micro-batches
    (reported on the last): a block reported out of order, changed after it was reported, or a
    gradient summed block by block that differs from the one summed at the end."""
    first, second = _batch(model), _batch(model, seed=1)
    w = _workers(model, workers)
    try:
        model.zero_grad()
        w.accumulate(first, 0.5)
        middle = model.layout.grads.copy()
        w.accumulate(second, 0.5)
        want = model.layout.grads.copy()
        model.layout.grads[:] = middle
        rec = Recorder(model)
        w.accumulate(second, 0.5, rec)
    finally:
        if isinstance(w, DataParallel):
            w.close()
    out = [] if rec.order == [2, 1, 0] else [f"order {rec.order}"]
    out += [f"block {i} changed after it was reported" for i in rec.premature()]
    return out + ([] if np.array_equal(model.layout.grads, want) else ["the summed gradient differs"])


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("kind", [*MODELS, "lora"])
def test_a_block_is_final_when_the_backward_reports_it(kind, workers):
    assert faults(_model("gpt" if kind == "lora" else kind, lora=kind == "lora"), workers) == []


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_block_reported_before_its_backward_is_caught(monkeypatch, workers):
    """The check above can fail: a backward that reports each block before running it."""
    def early(self, dlogits):
        grad = self.residual.grad(self.ln_f.backward(self._head_backward(dlogits)))
        for i in reversed(range(len(self.blocks))):
            if self.block_done is not None:
                self.block_done(i)
            self.blocks[i].backward_stream(grad)
        self.embed.backward(grad.finish())
    monkeypatch.setattr(GPT, "backward", early)
    assert faults(_model("gpt"), workers) != []


@pytest.mark.parametrize("kind", list(MODELS))
def test_buckets_cover_the_layout_once(kind):
    model = _model(kind)
    b = Buckets.of(model)
    covered = np.zeros(model.layout.size, int)
    for ranges in b.order():
        for lo, hi in ranges:
            covered[lo:hi] += 1
    assert (covered == 1).all(), kind
    assert b.order()[0] == b.blocks[-1] and b.order()[-1] == b.rest, kind
    assert all(b.blocks) and b.rest, kind                 # every block has a bucket, and so do the rest
    late = model.late_gradients()
    assert bool(late) == ("residual" in MODELS[kind]), kind      # depth attention: late by design
    for name in late:                                     # completed at the end: in the last bucket
        e = model.layout.entries[name]
        assert any(a <= e.offset and e.offset + e.size <= z for a, z in b.rest), name


def test_a_model_whose_backward_reports_no_blocks_is_one_bucket():
    from tbp.nn.build import build_model
    model = build_model(ModelConfig.from_dict(dict(arch="encoder-decoder", vocab_size=13, n_ctx=8, n_layer=2, n_head=2,
                                    d_model=8, pad_id=0)))
    b = Buckets.of(model)
    assert b.n_blocks == 0 and b.rest == [(0, model.layout.size)]


@pytest.mark.parametrize("ranges", [[(0, 5), (5, 20000), (20000, 20003)], [(0, 3 << 20)], [(7, 9), (40, 50)]])
def test_messages_send_long_ranges_from_the_buffer_and_pack_the_short(ranges):
    from tbp.train.gradsync import CHUNK, SHORT, messages
    def merged(spans):
        out = []
        for a, b in sorted(spans):
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out
    out = messages(ranges)
    sent = [r for m in out for r in m]
    assert merged(sent) == merged(ranges) and sum(b - a for a, b in sent) == sum(b - a for a, b in ranges)
    for m in out:
        assert len(m) == 1 or all(b - a < SHORT for a, b in m)   # only short ranges are packed
        assert sum(b - a for a, b in m) <= CHUNK


@pytest.mark.parametrize("n,size", [(10, 3), (7, 2), (1, 4), (12, 4)])
def test_shards_are_contiguous_and_cover_everything(n, size):
    counts = shard_counts(n, size)
    assert sum(counts) == n and len(counts) == size and max(counts) - min(counts) <= 1


@pytest.mark.parametrize("cut", [[0, 40, 97], [0, 300, 301, 1400]])
def test_adamw_slices_update_their_entries_as_the_whole_does(cut):
    model = GPT(ModelConfig.from_dict(dict(**BASE)), seed=0)
    rng = np.random.default_rng(0)
    whole = AdamW(model.layout, weight_decay=0.1)
    start = model.layout.params.copy()
    cut = [*cut, model.layout.size]
    parts = [whole.slice(a, b) for a, b in zip(cut, cut[1:])]
    grads = [rng.standard_normal(model.layout.size).astype(np.float32) for _ in range(3)]
    for g in grads:                                        # the whole optimizer, three steps
        model.layout.grads[:] = g
        whole.step(1e-2)
    after = model.layout.params.copy()
    model.layout.params[:] = start
    for g in grads:                                        # each slice steps its own entries
        model.layout.grads[:] = g
        for p in parts:
            p.step(1e-2)
    np.testing.assert_array_equal(model.layout.params, after)
    gathered = parts[0].whole()
    for p in parts[1:]:
        gathered.m[p.lo:p.hi], gathered.v[p.lo:p.hi] = p.m, p.v
    np.testing.assert_array_equal(gathered.m, whole.m)
    np.testing.assert_array_equal(gathered.v, whole.v)
    assert gathered.t == whole.t == 3
    assert sum(p.m.size for p in parts) == whole.m.size        # no slice holds more than its own
    with pytest.raises(ValueError, match="gather"):
        parts[0].state_arrays()
