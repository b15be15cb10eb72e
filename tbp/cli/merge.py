"""`tbp merge`: fold a LoRA run's adapters into plain weights."""
from __future__ import annotations

from pathlib import Path

import click

from ..runs import commit, disk
from ..errors import TbpError
from ..files.atomic import from_recorded
from ..nn.lora import merge_lora
from .common import console, one_run, load_run


@click.command()
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path), required=False)
@click.option("--checkpoint", "run_opt", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The run, as the other commands take it; the same as RUN.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the merged checkpoint.")
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@click.option("--best", is_flag=True, help="Fold the adapters of the best validation loss, not the last ones.")
def merge(run, run_opt, out, force, best):
    """Fold a LoRA run into a plain checkpoint: W <- W + (alpha/r) lora_down @ lora_up.

    The result loads and generates like any run, without the base, and can itself be
    fine-tuned again.

    \b
    Example:
      tbp merge checkpoints/notes-lora --out checkpoints/notes-lora-merged
      tbp merge --checkpoint checkpoints/notes-lora --best --out checkpoints/notes-best
    """
    run = one_run(run, run_opt, lora=True)
    cfg = disk.read_config(run)
    if not cfg.get("lora"):
        raise TbpError(f"{run} has no LoRA adapters to merge (it is already a plain checkpoint)")
    inputs = (run, from_recorded(run, cfg["base"]["path"]) if cfg.get("base") else None)   # the adapter run, its base
    commit.claim_run_output(out, force, inputs)
    model, tok, cfg = load_run(run, best=best)
    merge_lora(model)
    state = disk.read_state(run)
    step = state.get("best_step") if best and state.get("best_step") is not None else state.get("step", 0)
    record = {"model": model.config.to_dict(), "train": cfg.get("train"),
              # what it was trained on, and how (a pairs run completes sources): the merged model's too
              **{k: cfg.get(k) for k in disk.DATA_FIELDS}, "lora": None, "base": None, "merged_from": {"run": str(run.resolve()), "lora": cfg["lora"],
                                                          "base": {**cfg["base"], "path": str(inputs[1].resolve())}},
              "step": step}
    commit.save_plain(out, model, tok, record, force, inputs)
    console.print(f"merged {run} (rank {cfg['lora']['rank']}, {', '.join(cfg['lora']['targets'])}) "
                  f"into {out}; generate with: tbp generate --checkpoint {out}")
