"""The documentation's example pictures, drawn from the default run (`tbp train` with no options)
and, when it exists, the reversal run of the paired-data guide (docs/how-to/pairs.md).

    tbp train                    # checkpoints/pydoc, about three minutes
    python docs/pictures.py      # docs/images/training.png and docs/images/attention.png
                                 # (+ docs/images/cross_attention.png from checkpoints/reverse)
"""
import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tbp(*args):
    subprocess.run([sys.executable, "-m", "tbp", *map(str, args)], check=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--run", default="checkpoints/pydoc")
    p.add_argument("--prompt", default="def f(x):\n    return x")
    p.add_argument("--reverse-run", default="checkpoints/reverse")
    a = p.parse_args()
    out = HERE / "images"
    out.mkdir(exist_ok=True)
    tbp("plot", a.run, "--out", out / "training.png")
    tbp("attention", "--checkpoint", a.run, "--prompt", a.prompt, "--layer", 0, "--out", out / "attention.png")
    if Path(a.reverse_run).is_dir():
        tbp("attention", "--checkpoint", a.reverse_run, "--prompt", "1234567", "--layer", 1,
            "--out", out / "cross_attention.png")


if __name__ == "__main__":
    main()
