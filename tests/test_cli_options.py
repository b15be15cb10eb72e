"""Options are declared once (the config dataclasses); the CLI, --config and errors derive from them."""
from dataclasses import dataclass

import click
import pytest
from click.testing import CliRunner

from tbp.cli.options import config_options
from tbp.nn.config import ModelConfig
from tbp.train.config import TrainConfig
from tbp.nn.config import ConfigError, DictConfig, option

from helpers import clean_fail, run


def test_every_option_of_both_configs_is_a_train_flag_with_its_default_and_help():
    help_text = " ".join(run(["train", "--help"]).output.split())
    for cls in (ModelConfig, TrainConfig):
        for f in cls.options():
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            assert flag.split("/")[0] in help_text, f.name
            assert " ".join(f.metadata["help"].split())[:30] in help_text, f.name
    assert "--vocab-size" in help_text and "--causal" not in help_text      # derived, not options


def test_a_new_field_becomes_a_flag_with_no_other_edit():
    @dataclass
    class Toy(DictConfig):
        mlp_ratio: int = option(4, "Hidden width of the MLP over d_model.", min=1, max=16)
        norm: str = option("layer", "Which norm.", choices=("layer", "rms"))
        gate: bool = option(True, "A gate.")

    @click.command()
    @config_options(Toy)
    def cmd(**kw):
        click.echo(repr(Toy(**kw)))

    r = CliRunner().invoke(cmd, ["--mlp-ratio", "8", "--norm", "rms", "--no-gate"])
    assert r.exit_code == 0 and "mlp_ratio=8, norm='rms', gate=False" in r.output
    assert CliRunner().invoke(cmd, ["--mlp-ratio", "17"]).exit_code == 2
    assert CliRunner().invoke(cmd, ["--norm", "batch"]).exit_code == 2
    with pytest.raises(ConfigError, match="mlp_ratio must be <= 16"):
        Toy(mlp_ratio=17)


@pytest.mark.parametrize("kw,msg", [
    (dict(n_layer=0), "n_layer must be >= 1"), (dict(n_layer=True), "n_layer must be an integer"),
    (dict(activation="tanh"), "activation must be one of gelu, relu"), (dict(ln_eps=float("nan")), "finite"),
    (dict(d_model=10, n_head=4), "divisible"), (dict(bias="yes"), "true or false"),
])
def test_model_config_refuses_values_outside_their_declaration(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ModelConfig(**kw)


@pytest.mark.parametrize("kw,msg", [(dict(lr=float("nan")), "finite"), (dict(lr=0.0), "lr must be > 0"),
                                    (dict(beta2=1.0), "beta2 must be < 1"), (dict(min_lr=1.0), "must not exceed")])
def test_train_config_refuses_values_outside_their_declaration(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        TrainConfig(**kw)


@pytest.mark.parametrize("args,msg", [
    (["--lr", "nan"], "not a finite number"), (["--lr", "inf"], "not a finite number"),
    (["--ln-eps", "nan"], "not a finite number"), (["--d-model", "32", "--n-head", "3"], "divisible"),
])
def test_bad_option_values_are_usage_errors(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    clean_fail(run(["train", *args]), 2, msg)
    assert not (tmp_path / "data").exists() and not (tmp_path / "checkpoints").exists()   # nothing written


def test_bench_usage_error_exits_2():
    clean_fail(run(["bench", "--d-model", "3", "--n-head", "2"]), 2, "divisible")


def test_a_bug_shows_its_traceback_and_says_it_is_a_bug(tmp_path, corpus_file, monkeypatch):
    """A programming error inside the engine is not the user's mistake: no one-line disguise."""
    from tbp.nn.layernorm import LayerNorm

    def broken(self, x):
        return x * self.params["weight"][:3]                    # a broadcasting bug
    monkeypatch.setattr(LayerNorm, "forward", broken)
    monkeypatch.chdir(tmp_path)
    r = run(["train", "--data", corpus_file, "--out", "r", "--max-iters", "2", "--n-layer", "1", "--n-head", "2",
             "--d-model", "16", "--n-ctx", "16", "-q"])
    assert r.exit_code == 1
    assert "Traceback" in r.output and "operands could not be broadcast" in r.output
    assert "this is a bug in tbp" in r.output
