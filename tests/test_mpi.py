"""Data-parallel training over MPI: `mpiexec -n 2 tbp train` against one process, resume across
the two, LoRA, faults (a raising rank, a killed rank, SIGTERM). Each MPI test launches mpiexec
as a subprocess (the test process itself never initialises MPI); they skip, saying why, where
mpi4py or a working MPI is missing -- `pip install -e '.[test]'` brings both."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tbp.train import distributed
from tbp.runs.disk import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--n-ctx", "16", "--batch-size", "6",
        "--eval-batches", "2", "--eval-interval", "3", "--log-interval", "1", "--threads", "1", "-q"]


def _mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"            # the launcher of the MPI mpi4py loads
    return str(here) if here.exists() else shutil.which("mpiexec")


def _env(mpiexec: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIEXEC_TIMEOUT="120")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_pml="ob1",
                   OMPI_MCA_btl="self,vader" if "OpenRTE" in version else "self,sm",
                   OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    return env


SHM = Path("/dev/shm")


def _shm_files() -> set:
    return set(SHM.glob("mpich_shm_*")) | set(SHM.glob("sm_segment.*")) if SHM.is_dir() else set()


@pytest.fixture(autouse=True)
def sweep_shared_memory():
    """A job that aborts leaves its shared-memory segments behind: remove the ones a test made."""
    before = _shm_files()
    yield
    for f in _shm_files() - before:
        f.unlink(missing_ok=True)


def mpi(n, args, cwd, timeout=120, wait=True):
    """`mpiexec -n N python ARGS` in cwd: (exit code, output), or the Popen with wait=False."""
    exe = _mpiexec()
    return job([exe, "-n", str(n), sys.executable, *map(str, args)], cwd, _env(exe), timeout, wait)


def job(cmd, cwd, env, timeout=120, wait=True):
    """A launcher command in its own session: (exit code, output), or the Popen with wait=False;
    killed, and the test failed, past ``timeout``."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if not wait:
        return p
    out = ended(p, timeout, f"the MPI job was still running after {timeout}s")
    return p.returncode, out


def ended(p, seconds, what) -> str:
    """The output of job ``p`` once it ends; killed, and the test failed with ``what``, past ``seconds``."""
    try:
        return p.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"{what}:\n{p.communicate()[0][-3000:]}")


def tbp(args, cwd):
    """One process, no launcher."""
    return subprocess.run([sys.executable, "-m", "tbp", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def mpi_ok(tmp_path_factory):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")
    if _mpiexec() is None:
        pytest.skip("no mpiexec: install an MPI (pip install -e '.[mpi]' brings MPICH)")
    rc, out = mpi(2, ["-c", "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2"],
                  tmp_path_factory.mktemp("probe"), timeout=60)
    if rc:
        pytest.skip(f"MPI is installed but a 2-rank job does not run here:\n{out[-1500:]}")


@pytest.fixture
def prepared(tmp_path, corpus_file):
    r = tbp(["prepare", "--data", corpus_file, "--out", tmp_path / "data"], tmp_path)
    assert r.returncode == 0, r.stderr
    return tmp_path / "data"


def losses(run):
    return [(m["step"], m["train_loss"], m.get("val_loss")) for m in read_metrics(run)]


def assert_same_run(a, b, rtol=2e-5, key_bias=True):
    """The same losses to rtol and the same last weights to 1e-4 / 1e-6; ``key_bias=False``
    leaves out the key biases, whose gradient is zero in exact arithmetic (paper 3.2), so that
    AdamW scales their rounding noise up to whole steps."""
    la, lb = losses(a), losses(b)
    assert [s for s, *_ in la] == [s for s, *_ in lb]
    for (s, ta, va), (_, tb, vb) in zip(la, lb):
        assert ta == pytest.approx(tb, rel=rtol), f"step {s}"
        assert (va is None) == (vb is None) and (va is None or va == pytest.approx(vb, rel=rtol)), f"step {s}"
    from safetensors.numpy import load_file
    def last_weights(run):                                      # model-* or, for LoRA, adapter-*
        return load_file(sorted([*Path(run).glob("model-*.safetensors"), *Path(run).glob("adapter-*.safetensors")])[-1])
    wa, wb = last_weights(a), last_weights(b)
    for k in wa:
        x, y = wa[k], wb[k]
        if not key_bias and k.endswith("attn.c_attn.bias"):      # [q | k | v]: drop the k third
            third = x.size // 3
            x, y = np.delete(x, np.s_[third:2 * third]), np.delete(y, np.s_[third:2 * third])
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=k)


def test_two_ranks_give_the_one_process_run(mpi_ok, tmp_path, prepared):
    rc, out = mpi(2, ["-m", "tbp", "train", "--data", prepared, "--out", "mpi", "--max-iters", 6, *TINY], tmp_path)
    assert rc == 0, out
    assert out.count("training finished") == 1                   # rank 0 speaks for the job
    r = tbp(["train", "--data", prepared, "--out", "one", "--max-iters", 6, *TINY], tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "mpi", tmp_path / "one")
    rc, out = mpi(2, ["-m", "tbp", "train", "--data", prepared, "--out", "again", "--max-iters", 6, *TINY], tmp_path)
    assert rc == 0, out                               # the same ranks and threads: the same bits
    assert losses(tmp_path / "again") == losses(tmp_path / "mpi")
    from safetensors.numpy import load_file
    a, b = (load_file(tmp_path / run / "model-000006.safetensors") for run in ("again", "mpi"))
    assert all(np.array_equal(a[k], b[k]) for k in b)


def test_resume_crosses_between_mpi_and_one_process(mpi_ok, tmp_path, prepared):
    run = ["--data", prepared, "--out", "run", *TINY]
    rc, out = mpi(2, ["-m", "tbp", "train", *run, "--max-iters", 3], tmp_path)
    assert rc == 0, out
    r = tbp(["train", "--out", "run", "--resume", "--max-iters", 6, "-q"], tmp_path)       # MPI -> one
    assert r.returncode == 0, r.stderr
    rc, out = mpi(2, ["-m", "tbp", "train", "--out", "run", "--resume", "--max-iters", 9, "-q"], tmp_path)
    assert rc == 0, out                                                                     # one -> MPI
    r = tbp(["train", "--data", prepared, "--out", "straight", *TINY, "--max-iters", 9], tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "run", tmp_path / "straight")


def _same_bits(a, b, name):
    from safetensors.numpy import load_file
    x, y = load_file(Path(a) / name), load_file(Path(b) / name)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("model", [["--n-layer", "3"], ["--n-layer", "3", "--residual", "attention"]],
                         ids=["gpt", "attention-residuals"])
def test_overlap_and_a_sharded_optimizer_give_the_plain_run(mpi_ok, tmp_path, prepared, model):
    """Overlapped buckets sum the same numbers as one allreduce: the same bits. The sharded
    optimizer updates every entry as the whole AdamW does, its clipping norm summed from the
    slices (rounding only); its checkpoints hold the whole moments."""
    run = ["-m", "tbp", "train", "--data", prepared, "--max-iters", 6, *TINY, *model,
           "--threads", "2", "--grad-accum", "2"]
    ways = {"plain": [], "overlap": ["--overlap"], "sharded": ["--shard-optimizer"],
            "sharded-overlap": ["--shard-optimizer", "--overlap"]}
    for name, extra in ways.items():
        rc, out = mpi(2, [*run, "--out", name, *extra], tmp_path)
        assert rc == 0, out
    assert losses(tmp_path / "overlap") == losses(tmp_path / "plain")
    for f in ("model-000006.safetensors", "optimizer-000006.safetensors"):
        assert _same_bits(tmp_path / "overlap", tmp_path / "plain", f), f
        assert _same_bits(tmp_path / "sharded-overlap", tmp_path / "sharded", f), f
    assert_same_run(tmp_path / "sharded", tmp_path / "plain", rtol=1e-6)
    from safetensors.numpy import load_file
    a, b = (load_file(tmp_path / r / "optimizer-000006.safetensors") for r in ("sharded", "plain"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-9, err_msg=k)


def test_a_rank_with_no_rows_still_sends_its_buckets(mpi_ok, tmp_path, prepared):
    """3 ranks, a batch of 2: one rank has no rows, and reports every block at once."""
    model = [*TINY, "--n-layer", "2", "--batch-size", "2"]
    rc, out = mpi(3, ["-m", "tbp", "train", "--data", prepared, "--out", "three", "--max-iters", 4, *model,
                      "--overlap", "--shard-optimizer"], tmp_path)
    assert rc == 0, out
    r = tbp(["train", "--data", prepared, "--out", "one", "--max-iters", 4, *model], tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "three", tmp_path / "one")


def test_a_sharded_run_resumes_under_any_number_of_ranks(mpi_ok, tmp_path, prepared):
    run = ["--data", prepared, "--out", "run", *TINY, "--n-layer", "2"]
    sharded = ["--shard-optimizer", "--overlap"]
    rc, out = mpi(2, ["-m", "tbp", "train", *run, *sharded, "--max-iters", 3], tmp_path)
    assert rc == 0, out
    r = tbp(["train", "--out", "run", "--resume", "--max-iters", 6, "-q"], tmp_path)           # 2 ranks -> one
    assert r.returncode == 0, r.stderr
    rc, out = mpi(3, ["-m", "tbp", "train", "--out", "run", "--resume", *sharded, "--max-iters", 9, "-q"],
                  tmp_path)                                                                   # one -> 3 ranks
    assert rc == 0, out
    r = tbp(["train", "--data", prepared, "--out", "straight", *TINY, "--n-layer", "2", "--max-iters", 9], tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "run", tmp_path / "straight")


@pytest.mark.parametrize("ways", [[], ["--shard-optimizer", "--overlap"]], ids=["plain", "sharded-overlap"])
def test_lora_fine_tuning_under_mpi(mpi_ok, tmp_path, prepared, ways):
    r = tbp(["train", "--data", prepared, "--out", "base", "--max-iters", 3, *TINY, "--untie-head"], tmp_path)
    assert r.returncode == 0, r.stderr
    lora = ["--init-from", "base", "--data", prepared, "--lora-rank", "2", "--lora-targets", "all,lm_head",
            "--max-iters", 4, *TINY[8:]]
    rc, out = mpi(2, ["-m", "tbp", "train", *lora, "--out", "mpi", *ways], tmp_path)   # only the adapters are packed
    assert rc == 0, out
    r = tbp(["train", *lora, "--out", "one"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "mpi", tmp_path / "one")


def test_a_setup_error_is_one_line_and_every_rank_exits(mpi_ok, tmp_path, prepared):
    rc, out = mpi(2, ["-m", "tbp", "train", "--out", "nothing-here", "--resume", "-q"], tmp_path, timeout=60)
    assert rc == 1, out
    assert out.count("has no checkpoint") + out.count("no such") == 1, out
    assert "Traceback" not in out


@pytest.mark.parametrize("ways", [[], ["--shard-optimizer", "--overlap", "--n-layer", "2"]], ids=["plain", "sharded-overlap"])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_whole_job(mpi_ok, tmp_path, prepared, how, ways):
    start = time.monotonic()
    rc, out = mpi(2, [ROOT / "tests" / "programs" / "faulty_rank.py", 1, 3, how, "train", "--data", prepared,
                      "--out", "run", "--max-iters", 1000, *TINY, *ways], tmp_path, timeout=60)
    assert rc != 0, out
    assert time.monotonic() - start < 30, "the other rank waited for the one that failed"
    if how == "raise":
        assert "rank 1:" in out and "deliberate failure on rank 1" in out, out


def test_a_rank_that_leaves_before_joining_ends_the_job(mpi_ok, tmp_path, prepared):
    """A rank that exits (status 0) before the ranks join: the others must not wait for ever."""
    start = time.monotonic()
    rc, out = mpi(2, [ROOT / "tests" / "programs" / "rank_leaves.py", "exit", "train", "--data", prepared,
                      "--out", "run", "--max-iters", 5, *TINY], tmp_path, timeout=60)
    assert rc != 0, out
    assert time.monotonic() - start < 30, "rank 0 waited for the rank that left"
    assert "rank 1: left the job before its end; stopping every rank" in out, out
    assert not (tmp_path / "run" / "state.json").exists()


@pytest.mark.parametrize("how,says", [("version", "tbp 0.0.1+elsewhere here"), ("data", "holds other data than rank 0's")])
def test_a_rank_unlike_rank_0_is_one_line_and_ends_the_job(mpi_ok, tmp_path, prepared, how, says):
    rc, out = mpi(2, [ROOT / "tests" / "programs" / "rank_differs.py", how, "train", "--data", prepared,
                      "--out", "run", "--max-iters", 5, *TINY], tmp_path, timeout=60)
    assert rc != 0, out
    said = " ".join(out.split())                                 # the console wraps long lines
    assert said.count(says) == 1 and said.count("rank 1:") == 1, out
    assert "Traceback" not in out
    # nothing saved: at most rank 0's lock on the folder, which a new run takes over
    assert {p.name for p in (tmp_path / "run").iterdir()} <= {".lock"}
    r = tbp(["train", "--data", prepared, "--out", "run", "--max-iters", 1, *TINY], tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("how,target", [("stall", "mpiexec"), ("stall-follower", "rank0")])
def test_sigterm_ends_ranks_waiting_in_a_collective(mpi_ok, tmp_path, prepared, how, target):
    """One rank waits in a collective while the other is busy (rank 1 in the set-up broadcast;
    rank 0 in the join). SIGTERM -- to mpiexec, or to the waiting rank alone, as a scheduler
    signalling every process does -- ends the job in seconds: the rank handles the signal while
    it waits (blocked inside MPI's C call it would not, until the other rank came: a minute)."""
    p = mpi(2, [ROOT / "tests" / "programs" / "rank_leaves.py", how, "train", "--data", prepared,
                "--out", "run", "--max-iters", 5, *TINY], tmp_path, wait=False)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)                                         # the waiting rank is in the collective by now
    os.kill(p.pid if target == "mpiexec" else int((tmp_path / "rank0.pid").read_text()), signal.SIGTERM)
    start = time.monotonic()
    out = ended(p, 40, "the job did not end after SIGTERM")
    assert p.returncode != 0, out
    assert time.monotonic() - start < 15, out


def test_sigterm_saves_once_and_the_run_resumes(mpi_ok, tmp_path, prepared):
    p = mpi(2, ["-m", "tbp", "train", "--data", prepared, "--out", "run", *TINY, "--eval-interval", 50,
                "--max-iters", 100000], tmp_path, wait=False)
    deadline = time.monotonic() + 60
    while not (tmp_path / "run" / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGTERM)
    out = ended(p, 60, "the job did not stop after SIGTERM")
    assert out.count("SIGTERM: finishing this step and saving") == 1, out
    assert out.count("interrupted: saved") == 1, out
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["step"] % 50 != 0 or state["step"] > 50         # saved where it stopped, not only at evals
    r = tbp(["train", "--out", "run", "--resume", "--max-iters", state["step"] + 2, "-q"], tmp_path)
    assert r.returncode == 0, r.stderr


def test_ranks_with_different_parameters_are_caught(mpi_ok, tmp_path):
    code = ("import numpy as np\nfrom tbp.train import distributed\nfrom tbp.errors import TbpError\n"
            "w = distributed.world()\nx = np.arange(5, dtype=np.float32)\nw.check_same(x, 'same')\n"
            "x[w.rank] += 1\ntry:\n    w.check_same(x, 'the parameters')\nexcept TbpError as e:\n"
            "    open(f'caught{w.rank}', 'w').write(f'{e.everywhere} {e}')\nw.finish()\n")
    rc, out = mpi(2, ["-c", code], tmp_path, timeout=60)
    assert rc == 0, out
    for rank in (0, 1):                                 # both ranks raise, alike
        assert (tmp_path / f"caught{rank}").read_text().startswith(
            "True the parameters differ between ranks (rank 1 vs rank 0)")


class FakeWorld(distributed.World):
    def __init__(self, rank, size):
        self.rank, self.size, self.is_root = rank, size, rank == 0


@pytest.mark.parametrize("B,size", [(6, 2), (5, 3), (2, 3)])
def test_ranks_shares_add_up_to_the_whole_batch_gradient(B, size):
    """Each rank's part, scaled by its share of the rows or of the loss weight, sums to the
    gradient of the whole batch's mean loss (no MPI: the ranks' parts are summed here)."""
    from tbp.nn.gpt import GPT
    from tbp.nn.config import ModelConfig
    from tbp.nn.batch import Batch
    from tbp.train.parallel import Ranks, Serial
    rng = np.random.default_rng(0)
    model = GPT(ModelConfig(vocab_size=13, n_ctx=8, n_layer=1, n_head=2, d_model=8), dtype=np.float64)
    batch = Batch(rng.integers(0, 13, (B, 8)), rng.integers(0, 13, (B, 8)), (rng.random((B, 8)) < 0.6) * 1.0)
    batch.weights[:, 0] = 1.0
    for b in (batch, Batch(batch.idx, batch.targets)):
        want_loss = model.loss_and_backward(b.idx, b.targets, b.weights)
        want = model.layout.grads.copy()
        model.zero_grad()
        loss = sum(Ranks(Serial(model), FakeWorld(r, size)).accumulate(b) for r in range(size))
        assert loss == pytest.approx(want_loss, rel=1e-12)
        np.testing.assert_allclose(model.layout.grads, want, rtol=1e-10, atol=1e-14)
        model.zero_grad()


def test_without_a_launcher_mpi_is_never_loaded(tmp_path, corpus_file):
    code = ("import sys\nfrom tbp.cli.main import main\nsys.argv = ['tbp', 'train', '--data', sys.argv[1], '--out', 'r', "
            "'--max-iters', '2', '--n-layer', '1', '--d-model', '16', '--n-ctx', '16', '-q']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'mpi4py.MPI' not in sys.modules\nprint('no MPI')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_", "PMIX"))}
    r = subprocess.run([sys.executable, "-c", code, str(corpus_file)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "no MPI" in r.stdout, r.stderr


def test_a_launcher_without_mpi4py_is_one_line(tmp_path, corpus_file):
    """Started by a launcher (its variables set) where mpi4py cannot be imported: one line, exit 1,
    nothing written."""
    code = ("import sys\nsys.modules['mpi4py'] = None\nfrom tbp.cli.main import main\n"
            "sys.argv = ['tbp', 'train', '--data', sys.argv[1], '--out', 'r', '--max-iters', '2', '-q']\nmain()\n")
    env = {**os.environ, "PMI_SIZE": "2", "PMI_RANK": "0"}
    r = subprocess.run([sys.executable, "-c", code, str(corpus_file)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    said = " ".join(r.stderr.split())
    assert "mpi4py is not installed: pip install 'tbp[mpi]'" in said and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2 and not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["0", "0.001", "-3", "nan", "inf", "soon"])
def test_an_mpi_timeout_no_step_could_meet_is_refused(monkeypatch, value):
    from tbp.train.distributed import comm_timeout
    from tbp.errors import TbpError
    monkeypatch.setenv("TBP_MPI_TIMEOUT", value)
    with pytest.raises(TbpError, match="at least 1"):
        comm_timeout()
    monkeypatch.setenv("TBP_MPI_TIMEOUT", "2.5")
    assert comm_timeout() == 2.5


def test_a_stop_signal_ends_a_wait_for_an_unresponsive_rank_within_its_grace(monkeypatch):
    """SIGTERM while a peer never answers: the job ends once the grace has passed -- the longer of
    STOP_GRACE_S and twice the longest step seen, measured between the loop's any() calls (a
    step's gradient sums come in many chunked collectives, which must not shorten it) -- with
    128 + the signal, not after TBP_MPI_TIMEOUT."""
    import signal as sig
    from tbp.train import distributed
    clock = [1000.0]
    monkeypatch.setattr(distributed.time, "monotonic", lambda: clock[0])
    world = object.__new__(distributed.MPIWorld)
    world.rank, world.timeout, world.stop_signal, world.step_done, world.longest_step = 1, 600.0, None, None, 0.0
    aborted = []

    def abort(code):
        aborted.append((code, clock[0]))
        raise SystemExit(code)
    world.abort = abort

    class Done:
        def Test(self):
            return True

    class Never:
        def Test(self):
            clock[0] += 0.5
            return False

    class Comm:                                  # any()'s allreduce, completing at once
        def Iallreduce(self, *a, **kw):
            return Done()
    world.comm = Comm()
    world.MPI = type("MPI", (), {"IN_PLACE": None, "MAX": None})

    def step(seconds: float) -> None:            # a step: work, ten chunked sums, then any()
        clock[0] += seconds
        for _ in range(10):
            clock[0] += 0.01
            world._wait(Done())
        world.any(False)
    for seconds in (3.0, 3.0, 3.0):
        step(seconds)
    assert 3.0 < world.longest_step < 3.2 and world.stop_grace() == distributed.STOP_GRACE_S
    world.stopping(sig.SIGTERM)
    t0 = clock[0]
    with pytest.raises(SystemExit):
        world._wait(Never())
    code, when = aborted[0]
    assert code == 128 + sig.SIGTERM and distributed.STOP_GRACE_S < when - t0 < distributed.STOP_GRACE_S + 1
    world.stop_signal, aborted[:], world.step_done = None, [], clock[0]
    step(30.0)                                   # one 30 s step (an evaluation and a save, say)
    assert world.stop_grace() > 60.0
    world.stopping(sig.SIGINT)
    t0 = clock[0]
    with pytest.raises(SystemExit):
        world._wait(Never())
    assert aborted[0][0] == 128 + sig.SIGINT and 60 < aborted[0][1] - t0 < 61


def test_sigterm_ends_a_rank_at_once_while_mpi_starts(monkeypatch):
    """MPI_Init blocks in C until every rank has started: there SIGTERM must end the process by
    its default action (a Python handler would never run), and so must an alarm at the timeout;
    afterwards tbp's handler is back and no alarm is left."""
    import signal as sig
    from tbp.train import distributed
    seen = []

    def connect():
        seen.append((sig.getsignal(sig.SIGTERM), sig.getsignal(sig.SIGALRM), sig.getitimer(sig.ITIMER_REAL)[0]))
        return distributed.World()
    monkeypatch.setattr(distributed, "_WORLD", None)
    monkeypatch.setattr(distributed, "launched", lambda: True)
    monkeypatch.setattr(distributed, "_connect", connect)

    def mine(signum, frame):
        pass
    before = sig.signal(sig.SIGTERM, mine)
    try:
        monkeypatch.setenv("TBP_MPI_TIMEOUT", "45")
        distributed.world()
        (term, alarm, left), = seen                  # SIGALRM rings after TBP_MPI_TIMEOUT, ending the rank
        assert term == alarm == sig.SIG_DFL and 44 < left <= 45
        assert sig.getsignal(sig.SIGTERM) is mine and sig.getitimer(sig.ITIMER_REAL)[0] == 0
    finally:
        sig.signal(sig.SIGTERM, before)
