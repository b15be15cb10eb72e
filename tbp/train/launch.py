"""Setting up a training run: new, resumed, or initialised from another run (full or LoRA).

Everything here is decisions and validation: :func:`start` takes a :class:`RunRequest`
(what a front end parsed) and returns a ready :class:`~tbp.train.loop.Trainer`; the loop itself is
in loop.py and the terminal in cli/. A ``PrepareReport`` lets the front end show progress
while a raw text file is turned into a dataset on the fly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runs import commit, disk
from ..machine import memory
from ..data.batches import DoesNotFit, batches_for
from ..nn.config import ModelConfig
from .config import TrainConfig
from ..data.datasets import Dataset, PrepareReport, resolve_dataset
from ..errors import ConfigError, TbpError
from ..files.atomic import check_replaceable, portable_path, sweep_temporaries
from ..files.locks import RunLock
from ..nn.lora import LORA_TARGETS, add_lora
from ..nn import build
from ..nn.build import build_model, model_class
from ..nn.config import COMPUTE_FIELDS
from ..data.tokenizer import Tokenizer
from .loop import Callbacks, State, Trainer, trim_metrics


@dataclass
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


@dataclass
class RunRequest:
    """What to train: the options a front end parsed, before any decision is taken.

    ``model`` and ``train`` hold only the options the user gave (ModelConfig / TrainConfig
    field names): a new run fills in the defaults, a resumed run keeps its own values for the
    rest, and a model option that contradicts an existing model is refused.
    """
    out: Path | None = None             # run directory; default checkpoints/<dataset or base name>
    data: str | None = None             # a prepared folder, a text file or folder, None: built-in
    tokenizer: str = "char"             # for text prepared on the fly (new runs)
    vocab_size: int | None = None       # BPE vocabulary for text prepared on the fly
    resume: bool = False
    init_from: Path | None = None       # fine-tune this run's weights (all, or LoRA adapters)
    force: bool = False
    lora: LoraSpec | None = None
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    unknown_chars: str = "refuse"       # text encoded with a run's char tokenizer: its unknown characters


def start(req: RunRequest, callbacks: Callbacks | None = None,
          report: PrepareReport | None = None) -> Trainer:
    """The Trainer for a request: resume the run in ``out``, fine-tune ``init_from``, or start
    a new model on ``data``. (In an MPI world of several ranks, ranks.start_ranks calls
    this on rank 0 and has the others follow it.)"""
    if req.resume and req.init_from is not None:
        raise ConfigError("--resume continues a run; --init-from starts a new one: pick one")
    if req.resume and req.out is None:
        raise ConfigError("--resume needs --out, the run to continue")
    if req.lora is not None and req.init_from is None:
        raise ConfigError("--lora-rank fine-tunes an existing model: give it --init-from RUN")
    if req.unknown_chars != "refuse" and req.init_from is None and not req.resume:
        raise ConfigError("--unknown-chars is for text encoded with another run's tokenizer (--init-from or "
                          "--resume); a new run's tokenizer is made from its text and lacks nothing")
    tcfg = None if req.resume else TrainConfig(**req.train)     # every usage error before any work
    if req.init_from is not None:
        _check_base(req.init_from, req.lora, req.model)          # before any data is prepared
    elif not req.resume:
        ModelConfig.from_dict({"vocab_size": 1, **req.model})   # the vocabulary comes with the data
    if not req.resume and req.out is not None and not req.force:
        _refuse_a_committed_run(Path(req.out))                  # before any data is prepared
    if req.resume:
        ds = None
        if req.data is not None:
            kind = disk.read_config(req.out).get("data_kind") or "text"
            prepared = Path(req.data).is_dir() and (Path(req.data) / "meta.json").is_file()
            if kind != "text" and not prepared:        # on the fly is plain text: not this run's data
                raise TbpError(f"{req.out} was trained on {kind} data, and --data {req.data} is a raw file, which "
                               f"would be prepared as plain text; prepare it as {kind} (tbp prepare --format {kind} "
                               f"--data {req.data} --tokenizer-from {req.out} --out DIR) and pass that folder")
            ds = resolve_dataset(req.data, Tokenizer.load(Path(req.out) / "tokenizer.json"), report=report,
                                 unknown=req.unknown_chars)
        return resume(req.out, req.train, req.model, ds, callbacks)
    if req.init_from is not None:
        ds = resolve_dataset(req.data, Tokenizer.load(Path(req.init_from) / "tokenizer.json"), report=report,
                             unknown=req.unknown_chars)
        out = req.out or Path("checkpoints") / f"{Path(req.init_from).name}-{'lora' if req.lora else 'ft'}"
        return init_from(out, req.init_from, tcfg, ds, req.force, req.lora, req.model, callbacks)
    ds = resolve_dataset(req.data, None, req.tokenizer, req.vocab_size, report=report)
    derived = {"vocab_size": ds.tokenizer.vocab_size}
    arch = build.ARCH.get(req.model.get("arch", ModelConfig.defaults()["arch"]))   # unknown: ModelConfig says so
    if arch is not None:
        derived.update(arch.collation.derived(ds.kind, ds.meta))     # what the architecture takes from the data
    mcfg = ModelConfig.from_dict({**derived, **req.model})
    out = req.out or Path("checkpoints") / ds.path.name
    return new_run(out, mcfg, tcfg, ds, req.force, callbacks)


# --- run directories ------------------------------------------------------------------------
def claim_run_dir(out: Path, force: bool, inputs: tuple = ()) -> RunLock:
    """Lock ``out`` for this process, then make sure a new run may start there: it is new or
    empty, or holds only the uncommitted files of a run killed before its first checkpoint, or
    (with ``force``) a previous run; those are then removed. A folder with anything tbp did not
    write, or one of the run's own inputs, is never touched: the check runs before the lock is
    taken (a refused --out gets no .lock), and again under it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise TbpError(f"{out}: is a file, not a run directory")
    _check_claim(out, force, inputs)
    lock = RunLock(out).acquire()
    try:
        for p in _check_claim(out, force, inputs):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    except BaseException:
        lock.release(remove_if_alone=True)
        raise
    return lock


def _check_claim(out: Path, force: bool, inputs: tuple) -> list[Path]:
    """What must be removed for a new run to start in ``out``; TbpError if it may not."""
    contents = [p for p in out.iterdir() if p.name != RunLock.NAME] if out.is_dir() else []
    committed = (out / "state.json").is_file()
    if contents and not force:
        _refuse_a_committed_run(out)
    check_replaceable(out, disk.RUN_FILES, "config.json" if committed else RunLock.NAME,
                      "a tbp run", inputs)
    return contents


def _refuse_a_committed_run(out: Path) -> None:
    if (out / "state.json").is_file():
        raise TbpError(f"{out} already holds a run; use --resume to continue it, --force to replace it, "
                       f"or --out for a new one")


def _record(mcfg: ModelConfig, tcfg: TrainConfig, ds: Dataset, lora: LoraSpec | None,
            base: dict | None) -> dict:
    return {"model": mcfg.to_dict(), "train": tcfg.to_dict(), "data": str(ds.path),
            "data_source_sha256": ds.meta["source_sha256"], "data_kind": ds.kind,
            "lora": lora.to_dict() if lora else None, "base": base}


def new_run(out: Path, mcfg: ModelConfig, tcfg: TrainConfig, ds: Dataset, force: bool,
            callbacks=None) -> Trainer:
    """A fresh model on ``ds``. Nothing is written into ``out`` before the first checkpoint."""
    try:
        batches_for(ds, mcfg, model_class(mcfg).collation)     # the data suits the model: refused before anything is built
    except DoesNotFit as e:
        raise TbpError(f"{e}{e.new_run}") from None
    memory.check_train_fits(mcfg, tcfg, "training this model")
    memory.check_step_work(mcfg, tcfg.batch_size)
    lock = claim_run_dir(out, force, inputs=(ds.path,))
    with _released_on_failure(lock):
        model = build_model(mcfg, seed=tcfg.seed, dtype=np.dtype(tcfg.dtype))
        record = _record(mcfg, tcfg, ds, None, None)
        return Trainer(model, ds, tcfg, out, record, adapter=False, callbacks=callbacks, lock=lock)


@contextlib.contextmanager
def _released_on_failure(lock: RunLock):
    """Release a freshly claimed run directory (and remove it if it is empty) when setting up
    the run fails: a failed command leaves nothing behind."""
    try:
        yield
    except BaseException:
        lock.release(remove_if_alone=True)
        raise


def init_from(out: Path, base_run: Path, tcfg: TrainConfig, ds: Dataset, force: bool,
              lora: LoraSpec | None, model_overrides: dict, callbacks=None) -> Trainer:
    """Fine-tune a copy of ``base_run``'s weights: all of them, or LoRA adapters only."""
    if Path(out).resolve() == Path(base_run).resolve():
        raise ConfigError("--out must differ from --init-from: the base run is never modified")
    mcfg = _check_base(base_run, lora, model_overrides)
    memory.check_train_fits(mcfg, tcfg, f"fine-tuning {base_run}")
    memory.check_step_work(mcfg, tcfg.batch_size)
    lock = claim_run_dir(out, force, inputs=(base_run, ds.path))
    with _released_on_failure(lock):
        model, tok, _ = disk.load_model(base_run, dtype=np.dtype(tcfg.dtype), compute=_compute(model_overrides))
        if model.config != mcfg:       # a variant converts the base, or only the context changes (_check_base)
            convert = build.conversion(model.config, mcfg)
            model = convert(model) if convert is not None else _with_context(model, mcfg)
        base = None
        if lora:
            add_lora(model, lora.rank, lora.alpha, lora.targets, seed=tcfg.seed)
            weights = disk.weights_path(base_run)
            base = {"path": portable_path(Path(base_run), Path(out)), "sha256": disk.file_sha256(weights)}
        record = _record(model.config, tcfg, ds, lora, base)
        record["init_from"] = str(Path(base_run).resolve())
        return Trainer(model, ds, tcfg, out, record, adapter=lora is not None, callbacks=callbacks, lock=lock,
                       tokenizer=tok)


def resume(out: Path, train_overrides: dict, model_overrides: dict, ds: Dataset | None,
           callbacks=None) -> Trainer:
    """Continue the run in ``out`` exactly where its last complete checkpoint left it.

    Every file is validated before anything is written: the config, the state, the weights
    and moments (names, shapes, the same step), the tokenizer, and the data the run trained on.
    """
    out = Path(out)
    cfg = disk.read_config(out)
    lock = RunLock(out).acquire()
    try:
        return _resume(out, cfg, train_overrides, model_overrides, ds, callbacks, lock)
    except BaseException:
        lock.release()
        raise


def _resume(out, cfg, train_overrides, model_overrides, ds, callbacks, lock) -> Trainer:
    sweep_temporaries(out)
    where = out / "state.json"
    if not where.is_file():
        raise TbpError(f"{out}: has no checkpoint to resume from (state.json is missing)")
    run = disk.open_run(out, cfg)                  # every record of the run, read once
    state_d, files, tok = run.state, run.files, run.tokenizer
    if files["optimizer"] is None:
        raise TbpError(f"{out}: holds weights but no optimizer state (imported or merged), so it cannot be "
                       f"resumed; fine-tune it with tbp train --init-from {out}")
    try:
        TrainConfig.from_dict(cfg.get("train") or {})
    except ConfigError as e:
        raise TbpError(f"{out / 'config.json'}: bad training config ({e})") from None
    tcfg = TrainConfig.from_dict({**(cfg.get("train") or {}), **train_overrides})     # a usage error
    was = (cfg.get("train") or {}).get("optimizer", "adamw")          # runs before Muon: AdamW's
    if tcfg.optimizer != was:
        raise ConfigError(f"--optimizer {tcfg.optimizer} differs from the run's {was}: its saved state is "
                          f"{was}'s (an exact resume continues with it)")
    state = State(**{k: v for k, v in state_d.items() if k in State.__dataclass_fields__})
    data_rng = np.random.default_rng(tcfg.seed)
    if state.data_rng:
        try:
            data_rng.bit_generator.state = state.data_rng
        except (TypeError, ValueError, KeyError) as e:
            raise TbpError(f"{where}: data_rng is not a generator state ({e})") from None
    if state.tokenizer_sha256 and tok.sha256() != state.tokenizer_sha256:
        raise TbpError(f"{out / 'tokenizer.json'}: differs from the tokenizer this run was trained with "
                       f"(state.json records SHA-256 {state.tokenizer_sha256[:12]})")
    mcfg = run.model_config
    _refuse_model_changes(mcfg, model_overrides, f"the run being resumed ({out})")
    disk.verify_weights(out, cfg, mcfg, files=files)
    compute = _compute(model_overrides)
    mcfg = dataclasses.replace(mcfg, **compute)
    memory.check_train_fits(mcfg, tcfg, f"resuming {out}")
    memory.check_step_work(mcfg, tcfg.batch_size)
    model, w_meta = disk.model_of(run, dtype=np.dtype(tcfg.dtype), compute=compute)
    if ds is None:
        if not cfg.get("data"):
            raise TbpError(f"{out / 'config.json'}: names no dataset; pass --data")
        ds = Dataset.load(cfg["data"])
        recorded = cfg.get("data_source_sha256")
        if recorded and ds.meta["source_sha256"] != recorded:
            raise TbpError(f"{ds.path}: was prepared again from other text since {out} started "
                           f"(source SHA-256 {ds.meta['source_sha256'][:12]}, the run recorded {recorded[:12]}); "
                           f"pass --data with the original text to continue on it")
    if ds.tokenizer.sha256() != tok.sha256():
        raise TbpError(f"{ds.path}: its tokenizer differs from the one {out} was trained with")
    if ds.kind != (cfg.get("data_kind") or "text"):
        raise TbpError(f"{ds.path}: is {ds.kind} data, but {out} was trained on {cfg.get('data_kind') or 'text'} "
                       f"data; continue it on data of its own kind")
    adapter = bool(cfg.get("lora"))
    opt_arrays, opt_meta = disk.read_arrays(files["optimizer"])
    steps = {"state.json": state.step, "optimizer": opt_meta.get("step"), "weights": w_meta.get("step")}
    if len({str(v) for v in steps.values()}) != 1:
        raise TbpError(f"{out}: files are from different steps ({steps}); the checkpoint is damaged")
    # what a commit killed half-way wrote: swept once the committed set is proven whole
    commit.sweep_unreferenced(out, {k: p.name for k, p in files.items() if p is not None})
    record = {**{k: v for k, v in cfg.items() if k != "format"}, "model": mcfg.to_dict(), "train": tcfg.to_dict(),
              "data": str(ds.path), "data_source_sha256": ds.meta["source_sha256"], "data_kind": ds.kind}
    trainer = Trainer(model, ds, tcfg, out, record, adapter=adapter, callbacks=callbacks, state=state,
                      lock=lock, tokenizer=tok)
    try:
        trainer.opt.load_state_arrays(opt_arrays, state.step)
    except ValueError as e:
        raise TbpError(f"{files['optimizer']}: {e}") from None
    trainer.data_rng = data_rng
    trainer.last_saved_step = state.step
    trim_metrics(out, state.step)
    return trainer


def _check_base(base_run: Path, lora: LoraSpec | None, model_overrides: dict) -> ModelConfig:
    """The model config a fine-tune of a run trains, after refusing what cannot be: an adapter
    run, options that contradict its shape (unless a variant converts the base into them, e.g.
    grouped-query attention's pooled heads), a bad LoRA request, weights that do not match."""
    base_cfg = disk.read_config(base_run)
    if base_cfg.get("lora"):
        raise TbpError(f"{base_run} is a LoRA adapter run; fold it first with tbp merge {base_run} --out DIR")
    mcfg = disk.read_model_config(base_run, base_cfg)
    shape = {k: v for k, v in model_overrides.items() if k not in COMPUTE_FIELDS}
    target = mcfg.replace(**shape)                            # a ConfigError names a bad combination
    if build.conversion(mcfg, target) is None and not _context_only(mcfg, target):
        _refuse_model_changes(mcfg, model_overrides, f"the base run {base_run}")
    if lora:
        _check_lora(lora, target)
        if target != mcfg and model_class(target).shapes(target) != model_class(mcfg).shapes(mcfg):
            # an adapter run is loaded as its base's weights plus the adapters: weights a conversion
            # made (pooled key/value heads) would be in no file, and the run could not be loaded
            raise ConfigError(f"--lora-rank trains adapters on the base run's own weights, but these options "
                              f"change their shapes ({_changed(mcfg, target)}); fine-tune fully first "
                              f"(tbp train --init-from {base_run} ...), then add adapters to that run")
    disk.verify_weights(base_run, base_cfg, mcfg)
    return dataclasses.replace(target, **_compute(model_overrides))


def _context_only(before: ModelConfig, after: ModelConfig) -> bool:
    """Whether ``after`` differs from ``before`` only in its context and the weights keep their
    shapes: a model without a position table (rotary positions) trains at any length, so a
    fine-tune may choose its own (an imported model's 8,192 is more than a laptop trains at)."""
    b, a = before.flat(), after.flat()
    return {k for k in a if a[k] != b.get(k)} == {"n_ctx"} \
        and model_class(after).shapes(after) == model_class(before).shapes(before)


def _with_context(model, cfg: ModelConfig):
    """``model``'s weights in a model of ``cfg``, which differs only in its context (_context_only)."""
    twin = build.build_model(cfg, dtype=model.dtype)
    for name, p in model.params.items():
        twin.params[name][...] = p
    return twin


def _changed(before: ModelConfig, after: ModelConfig) -> str:
    """The flat options that differ between two configs, as flags with their new values."""
    b, a = before.flat(), after.flat()
    return ", ".join(f"--{k.replace('_', '-')} {a[k]}" for k in a if a[k] != b.get(k))


def _compute(overrides: dict) -> dict:
    """The options among ``overrides`` that a trained model may change on resume or fine-tune:
    the kernel (dense <-> flash, same results), dropout (training only) and recomputation."""
    return {k: v for k, v in overrides.items() if k in COMPUTE_FIELDS}


def _refuse_model_changes(cfg: ModelConfig, overrides: dict, what: str) -> None:
    current = cfg.flat()
    for k, v in overrides.items():
        if k not in COMPUTE_FIELDS and current.get(k) != v:
            raise ConfigError(f"--{k.replace('_', '-')} {v} differs from {what} ({current.get(k)}); "
                              f"a model's shape is fixed once trained")


def _check_lora(lora: LoraSpec, cfg: ModelConfig) -> None:
    """Usage errors in a LoRA request, named before anything is built or written."""
    why = build.refusal(cfg, "lora")
    if why is not None:
        raise ConfigError(why)
    if not lora.targets:
        raise ConfigError("--lora-targets needs at least one layer")
    # the narrowest side of any adapted matrix: C (c_attn, the projections, c_fc), or V (lm_head)
    widest = min(cfg.d_model, cfg.vocab_size) if "lm_head" in lora.targets else cfg.d_model
    if not 1 <= lora.rank <= widest:
        raise ConfigError(f"LoRA rank must be in [1, {widest}] for this model, got {lora.rank}")
    if "lm_head" in lora.targets and cfg.tie_head:
        raise ConfigError("LoRA target 'lm_head' needs an untied head; this model's head is wte (tied)")


def lora_targets(spec: str) -> tuple[str, ...]:
    """'attn,mlp' style shorthands -> LORA_TARGETS names."""
    groups = {"attn": ("attn.c_attn", "attn.c_proj"), "mlp": ("mlp.c_fc", "mlp.c_proj"),
              "all": LORA_TARGETS[:4]}
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        names = groups.get(part, (part,))
        for n in names:
            if n not in LORA_TARGETS:
                raise ConfigError(f"unknown LoRA target {n!r}; choose from {', '.join(LORA_TARGETS)}, "
                               f"or attn, mlp, all")
            if n not in out:
                out.append(n)
    return tuple(out)
