"""`tbp`: the command group."""
from __future__ import annotations

import click

from ..version import __version__
from .common import Group
from .gradcheck import gradcheck
from .prepare import prepare
from .train import train
from .generate import generate
from .merge import merge
from .info import info
from .bench import bench
from .interop import export, import_
from .pictures import attention, plot_runs
from .evaluate import evaluate_cmd
from .chat import chat
from .serve import serve
from .runs import runs
from .view import view


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tbp")
def main():
    """Train and understand GPT-style transformers on a CPU, every gradient written by hand.

    \b
    Quick start (offline, a few minutes on a laptop):
      tbp train            # prepares a built-in corpus, trains a small model
      tbp generate         # samples from the newest finished run under checkpoints/
      tbp gradcheck        # proves every handwritten gradient numerically
    """


for command in (prepare, train, generate, chat, evaluate_cmd, merge, info, bench, gradcheck, export, import_, plot_runs,
                attention, view, serve, runs):
    main.add_command(command)


if __name__ == "__main__":
    main()
