"""How the ranks of an MPI job set a run up (distributed.py): rank 0 exactly as one process
would (launch.start), the others from what it sends them -- checking that they run the same tbp
and NumPy and read the same data -- and then every rank joins the world."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import launch
from ..nn.config import ModelConfig
from .config import TrainConfig
from ..data.datasets import Dataset
from ..errors import ConfigError, TbpError
from ..nn.lora import add_lora
from ..nn.build import build_model
from .loop import State, Trainer


def start_ranks(req: "launch.RunRequest", callbacks, report, world) -> Trainer:
    """Rank 0 sets the run up exactly as one process would (the only rank that touches the run
    directory), then tells the others what to build: the configs, the training state and the
    dataset's path, or that it failed (they then exit with its code, silently: rank 0 says why).
    Every rank then joins the world: rank 0's parameters and moments everywhere."""
    if world.is_root:
        try:
            trainer = launch.start(req, callbacks, report)
        except BaseException as e:
            code = 2 if isinstance(e, ConfigError) else 130 if isinstance(e, KeyboardInterrupt) else 1
            world.bcast({"failed": code})
            e.everywhere = True             # the other ranks know: no need to abort them
            raise
        setup = {"run": str(trainer.run), "record": trainer.config_record, "train": trainer.cfg.to_dict(),
                 "model": trainer.model.config.to_dict(), "dtype": trainer.model.dtype.name,
                 "data": str(trainer.data.path.resolve()), "source_sha256": trainer.data.meta["source_sha256"],
                 "adapter": trainer.adapter, "state": trainer.state.to_dict(),
                 "data_rng": trainer.data_rng.bit_generator.state, "last_saved_step": trainer.last_saved_step,
                 "shapes": {k: list(p.shape) for k, p in trainer.model.params.items()}, "versions": versions()}
        world.bcast(setup)
    else:
        setup = world.bcast()
        if "failed" in setup:
            world.leave()                   # as rank 0 does, which says why
            raise SystemExit(setup["failed"])
        trainer = follow(setup, callbacks, world)
    trainer.join(world)
    return trainer


def versions() -> dict:
    """What every rank of a job must share to compute the same numbers."""
    from .. import version
    return {"tbp": version.__version__, "numpy": np.__version__}


def follow(setup: dict, callbacks, world) -> Trainer:
    """A rank other than 0: the same model and trainer as rank 0's, built from what it sent,
    writing nothing. Its weights are rank 0's once the trainer joins the world."""
    if setup.get("versions") != versions():
        mine, root = versions(), setup.get("versions") or {"tbp": "older than 0.1.0", "numpy": "?"}
        differ = ", ".join(f"{k} {mine[k]} here, {root[k]} on rank 0" for k in mine if mine[k] != root.get(k))
        raise TbpError(f"{differ}: every rank must run the same tbp and NumPy "
                       f"(the same environment on every machine)")
    path = Path(setup["data"])
    try:
        ds = Dataset.load(path)
    except TbpError as e:
        raise TbpError(f"{e} (every rank reads the dataset at rank 0's path: run on one "
                       f"machine, on a shared file system, or with the same copy on each)") from None
    if ds.meta.get("source_sha256") != setup["source_sha256"]:
        raise TbpError(f"{path} holds other data than rank 0's copy")
    tcfg = TrainConfig.from_dict(setup["train"])
    model = build_model(ModelConfig.from_dict(setup["model"]), seed=tcfg.seed, dtype=np.dtype(setup["dtype"]))
    lora = setup["record"].get("lora")
    if lora:
        add_lora(model, lora["rank"], lora["alpha"], tuple(lora["targets"]), seed=tcfg.seed)
    shapes = {k: list(p.shape) for k, p in model.params.items()}
    if shapes != setup["shapes"]:
        raise TbpError("built a model whose parameters differ from rank 0's")
    state = State(**setup["state"])
    trainer = Trainer(model, ds, tcfg, Path(setup["run"]), setup["record"], adapter=setup["adapter"],
                      callbacks=callbacks, state=state, tokenizer=ds.tokenizer)
    trainer.data_rng.bit_generator.state = setup["data_rng"]
    trainer.last_saved_step = setup["last_saved_step"]
    return trainer
