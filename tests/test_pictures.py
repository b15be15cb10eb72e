"""Pictures: training curves and attention maps, drawn headless from known numbers."""
import builtins
import json

import numpy as np
import pytest
from helpers import clean_fail, run, train_tiny

from tbp import GPT, ModelConfig
from tbp.look import plot

pytest.importorskip("matplotlib", reason="the plot extra is not installed: pip install -e '.[plot]'")


@pytest.fixture
def trained(tmp_path, corpus_file, monkeypatch):
    return train_tiny(tmp_path, corpus_file, monkeypatch, "r", 10)


def rgba(fig) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())


def pixel(fig, image, ax, x, y) -> np.ndarray:
    """The RGB at data point (x, y) of ``ax`` (origin of the image: top left)."""
    px, py = ax.transData.transform((x, y))
    return image[int(round(fig.bbox.height - py)), int(round(px)), :3].astype(int)


def test_an_attention_map_puts_each_weight_in_its_cell():
    from matplotlib import colormaps
    T = 5
    weights = np.zeros((2, T, T))
    weights[0] = np.eye(T)                                  # head 0: every token attends to itself
    weights[1][:, 0] = 1.0                                  # head 1: every token attends to the first
    fig = plot.attention_figure({3: weights}, list("abcde"))
    image = rgba(fig)
    axes = [ax for ax in fig.axes if ax.get_title().startswith("layer")]
    assert [ax.get_title() for ax in axes] == ["layer 3 · head 0", "layer 3 · head 1"]
    hot = (np.array(colormaps["viridis"](1.0)[:3]) * 255).astype(int)
    cold = (np.array(colormaps["viridis"](0.0)[:3]) * 255).astype(int)
    for h, ax in enumerate(axes):
        for i in range(T):
            for j in range(T):
                want = hot if weights[h, i, j] == 1 else cold
                assert np.abs(pixel(fig, image, ax, j, i) - want).max() <= 3, (h, i, j)
    assert [t.get_text() for t in axes[0].get_xticklabels()] == list("abcde")


def test_token_labels_make_whitespace_visible():
    assert plot.token_label("\n") == "\\n" and plot.token_label(" a") == "·a"
    assert plot.token_label("abcdefghijkl") == "abcdefg…"


def test_plot_draws_one_or_several_runs(trained, tmp_path):
    r = run(["plot", trained, trained, "--out", tmp_path / "c.png"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run(["plot", trained, "--out", tmp_path / "c.svg"]).exit_code == 0
    assert b"<svg" in (tmp_path / "c.svg").read_bytes()[:500]
    # a wrong suffix is a bad option value: a usage error (2), said before any work
    clean_fail(run(["plot", trained, "--out", tmp_path / "c.jpg"]), 2, "a picture is a .png or .svg file")
    clean_fail(run(["attention", "--checkpoint", trained, "--prompt", "the", "--out", tmp_path / "a.pdf"]), 2,
               "a picture is a .png or .svg file")


def test_the_training_figure_marks_the_best_validation_point():
    metrics = [{"step": s, "lr": 1e-3, "train_loss": 3.0 - s / 10, "grad_norm": 1.0} for s in range(1, 21)]
    for m, v in ((metrics[4], 2.5), (metrics[9], 2.1), (metrics[14], 2.3)):
        m.update(val_loss=v, val_bpb=v / 0.7, eval_train_loss=v)
    fig = plot.training_figure([{"label": "a", "metrics": metrics, "tokens_per_step": 100}])
    stars = [line for line in fig.axes[0].lines if line.get_marker() == "*"]
    assert len(stars) == 1 and stars[0].get_xdata()[0] == 10 and stars[0].get_ydata()[0] == 2.1


def test_attention_json_is_the_models_own_weights(trained):
    r = run(["attention", "--checkpoint", trained, "--prompt", "the cat", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["tokens"] == list("the cat") and set(d["layers"]) == {"0"}
    w = np.array(d["layers"]["0"])                          # (H, T, T)
    model = GPT.load(trained)
    want = model.attention_weights(np.array([d["ids"]]))[0][0]
    np.testing.assert_allclose(w, want, atol=1e-6)
    np.testing.assert_allclose(w.sum(-1), 1, atol=1e-5)
    assert np.triu(w, 1).max() == 0                         # causal: nothing from the future


def test_attention_in_the_terminal_and_as_a_picture(trained, tmp_path):
    r = run(["attention", "--checkpoint", trained, "--prompt", "the cat"])
    assert r.exit_code == 0 and "layer 0 · head 1" in r.output and "█" in r.output
    ruler = [line for line in r.output.splitlines() if line.strip().startswith("key →")]
    assert ruler and ruler[0].split("key →")[1].split() == list("the·cat")   # each column's key, labelled
    r = run(["attention", "--checkpoint", trained, "--prompt", "the cat", "--out", tmp_path / "a.png"])
    assert r.exit_code == 0 and (tmp_path / "a.png").stat().st_size > 1000
    clean_fail(run(["attention", "--checkpoint", trained, "--prompt", "the", "--layer", 5]), 2, "has 1 layer (0 .. 0)")


def test_flash_gives_the_same_attention_weights_as_dense():
    cfgs = [ModelConfig(vocab_size=11, n_ctx=16, n_layer=2, n_head=2, d_model=8, attn_impl=i) for i in ("dense", "flash")]
    idx = np.arange(12)[None] % 11
    dense, flash = (GPT(c, seed=0, dtype=np.float64).attention_weights(idx) for c in cfgs)
    for d, f in zip(dense, flash):
        np.testing.assert_allclose(f, d, rtol=1e-12, atol=1e-15)


def test_without_matplotlib_the_command_says_how_to_get_it(trained, tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    clean_fail(run(["plot", trained, "--out", tmp_path / "c.png"]), 1, "pip install 'tbp[plot]'")
    clean_fail(run(["plot", trained, "--layers", "--out", tmp_path / "c.png"]), 1, "pip install 'tbp[plot]'")
    clean_fail(run(["attention", "--checkpoint", trained, "--prompt", "the", "--out", tmp_path / "a.png"]), 1,
               "pip install 'tbp[plot]'")


def test_the_kept_positions_of_a_sparse_window_decoder(trained):
    """window, K = 6: once more than 6 tokens are cached, step t keeps the 4 sinks and t-1, t."""
    r = run(["attention", "--checkpoint", trained, "--prompt", "the cat sat", "--sparse", "window", "--budget", 6, "--sparse-layers", 0,
             "--json"])
    assert r.exit_code == 0, r.output
    kept = np.array(json.loads(r.stdout)["kept"])
    T = kept.shape[0]
    for t in range(T):
        want = np.zeros(T)
        want[:t + 1] = 1 if t + 1 <= 6 else 0
        if t + 1 > 6:
            want[[0, 1, 2, 3, t - 1, t]] = 1
        np.testing.assert_array_equal(kept[t], want, err_msg=str(t))
    r = run(["attention", "--checkpoint", trained, "--prompt", "the cat sat", "--sparse", "topk", "--budget", 4, "--sparse-layers", 0,
             "--out", "kept.png"])
    assert r.exit_code == 0, r.output


def test_a_causal_map_leaves_the_future_blank_and_names_its_axes():
    """The future no query may read is white, not the colour of a weight of 0; the axes say
    which is the query and which the key; the colour bar states its scale."""
    T = 4
    weights = np.tril(np.ones((1, T, T))) / np.arange(1, T + 1)[None, :, None]
    fig = plot.attention_figure({0: weights}, list("abcd"), causal=True)
    image = rgba(fig)
    ax = next(a for a in fig.axes if a.get_title().startswith("layer"))
    assert (pixel(fig, image, ax, 3, 0) == 255).all()                   # key 3 is in query 0's future
    assert not (pixel(fig, image, ax, 0, 3) == 255).all()               # query 3 reads key 0
    assert "query" in ax.get_ylabel() and "key" in ax.get_xlabel()
    assert any("square-root" in a.get_ylabel() for a in fig.axes if a is not ax)


def test_the_training_figure_keeps_best_values_in_its_legend_and_norms_readable():
    runs = []
    for k, label in enumerate(("a", "b")):
        metrics = [{"step": s, "lr": 1e-3, "train_loss": 3.0 - s / 10, "grad_norm": 10.0 ** (-s / 5)}
                   for s in range(1, 21)]
        metrics[9].update(val_loss=2.1 + k / 100, val_bpb=3.0, eval_train_loss=2.0)
        runs.append({"label": label, "metrics": metrics, "tokens_per_step": 100})
    fig = plot.training_figure(runs)
    rgba(fig)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["a (val; best 2.1 at step 10)", "b (val; best 2.11 at step 10)"]
    assert not fig.axes[0].texts                                         # no labels beside the stars to collide
    gnorm = fig.axes[4]
    shown = [t.get_text() for t in gnorm.get_yticklabels() if t.get_text()]
    assert "0.001" in shown and "0.0001" in shown
