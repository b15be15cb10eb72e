"""MPI across hosts, over a real network: two network namespaces of this machine, each with its
own interface, address and host name, joined by veth pairs through a bridge, stand in for two
machines. mpiexec starts one rank in each through a launcher that enters the namespace
(tests/programs/netns_launch, in the place of ssh), so the ranks talk over TCP -- the test
checks that the bytes went through the link -- and never through shared memory.

Needs root (to make namespaces), iproute2 and MPICH with mpi4py; skips, saying which is
missing, where it cannot make them.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_mpi import TINY, _env, _mpiexec, assert_same_run, ended, job, losses, tbp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "mpi"))
import netns  # noqa: E402  (benchmarks/mpi/netns.py: the namespaces, shared with the overlap benchmark)


class Hosts(netns.Hosts):
    def mpi(self, args, cwd, env=None, wait=True, timeout=120):
        """mpiexec over the two hosts, one rank each: (exit code, output), or the Popen."""
        exe = _mpiexec()
        return job(self.command(exe, args), cwd, {**_env(exe), **self.ENV, **(env or {})}, timeout, wait)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")
    if _mpiexec() is None:
        pytest.skip("no mpiexec: install an MPI (pip install -e '.[mpi]' brings MPICH)")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if not (shutil.which("ip") and shutil.which("unshare")):
        pytest.skip("making network namespaces needs iproute2 (ip) and util-linux (unshare)")
    try:
        h = Hosts()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    try:
        rc, out = h.mpi(["-c", "from mpi4py import MPI; import socket; print(socket.gethostname())"],
                        tmp_path_factory.mktemp("probe"), timeout=60)
        if rc:
            pytest.fail(f"namespaces made, but a two-host MPI job does not run:\n{out[-2000:]}")
        assert all(ns in out for ns in h.ns), out                  # one rank in each host
        yield h
    finally:
        h.close()


@pytest.fixture
def prepared(tmp_path, corpus_file):
    r = tbp(["prepare", "--data", corpus_file, "--out", tmp_path / "data"], tmp_path)
    assert r.returncode == 0, r.stderr
    return tmp_path / "data"


def _wait_for(path, p, seconds=60):
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline or p.poll() is not None:
            os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"{path} never appeared:\n{p.communicate()[0][-3000:]}")
        time.sleep(0.2)


@pytest.mark.parametrize("ways", [[], ["--shard-optimizer", "--overlap"]], ids=["plain", "sharded-overlap"])
def test_two_hosts_give_the_one_process_run_over_tcp(hosts, tmp_path, prepared, ways):
    before = hosts.sent(1)
    model = [*TINY, "--n-layer", "2"]
    rc, out = hosts.mpi(["-m", "tbp", "train", "--data", prepared, "--out", "two", "--max-iters", 6, *model, *ways],
                        tmp_path)
    assert rc == 0, out
    assert out.count("training finished") == 1
    r = tbp(["train", "--data", prepared, "--out", "one", "--max-iters", 6, *model], tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path / "two", tmp_path / "one")
    params = json.loads((tmp_path / "two" / "config.json").read_text())
    assert params["model"]["n_layer"] == 2 and params["train"]["overlap"] == bool(ways)
    # six steps' gradient sums (and the set-up's broadcasts) crossed host 2's link
    from safetensors.numpy import load_file
    numbers = sum(a.size for a in load_file(sorted((tmp_path / "two").glob("model-*.safetensors"))[-1]).values())
    assert hosts.sent(1) - before > 6 * 4 * numbers


def test_a_rank_killed_on_one_host_ends_the_job(hosts, tmp_path, prepared):
    start = time.monotonic()
    rc, out = hosts.mpi([ROOT / "tests" / "programs" / "faulty_rank.py", 1, 3, "kill", "train", "--data", prepared,
                         "--out", "run", "--max-iters", 1000, *TINY], tmp_path, timeout=90)
    assert rc != 0, out
    assert time.monotonic() - start < 45, "the other host's rank waited for the one that died"


def test_a_link_down_mid_run_ends_the_job_in_seconds_and_the_run_resumes(hosts, tmp_path, prepared):
    args = ["-m", "tbp", "train", "--data", prepared, "--out", "run", *TINY, "--eval-interval", 20,
            "--max-iters", 100000]
    p = hosts.mpi(args, tmp_path, env={"TBP_MPI_TIMEOUT": "5"}, wait=False)
    _wait_for(tmp_path / "run" / "state.json", p)
    time.sleep(1.0)
    hosts.link(1, up=False)                                  # host 2's cable pulled, mid-step
    start = time.monotonic()
    try:
        out = ended(p, 60, "the job did not end after the link went down")
    finally:
        hosts.link(1, up=True)
    took = time.monotonic() - start
    assert p.returncode != 0, out
    assert took < 30, f"the job took {took:.0f} s to end"
    assert "have not answered for 5 s" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    saved = json.loads((tmp_path / "run" / "state.json").read_text())["step"]
    assert saved >= 20
    # the last checkpoint resumes, on one process and on the two hosts
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    r = tbp(["train", "--out", "copy", "--resume", "--max-iters", saved + 4, "-q"], tmp_path)
    assert r.returncode == 0, r.stderr
    rc, out = hosts.mpi(["-m", "tbp", "train", "--out", "run", "--resume", "--max-iters", saved + 4, "-q"], tmp_path)
    assert rc == 0, out
    # the key bias's gradient is zero in exact arithmetic (paper 3.2): AdamW scales its rounding
    # noise up to whole steps, so it differs (by a few 1e-6) between the sum of two ranks and
    # one process; the losses and every other weight agree to rounding
    assert_same_run(tmp_path / "run", tmp_path / "copy", key_bias=False)


def test_sigterm_to_the_launcher_saves_and_the_run_resumes_on_both_hosts(hosts, tmp_path, prepared):
    p = hosts.mpi(["-m", "tbp", "train", "--data", prepared, "--out", "run", *TINY, "--eval-interval", 50,
                   "--max-iters", 100000], tmp_path, wait=False)
    _wait_for(tmp_path / "run" / "state.json", p)
    os.kill(p.pid, signal.SIGTERM)
    start = time.monotonic()
    out = ended(p, 60, "the job did not stop after SIGTERM")
    assert time.monotonic() - start < 30
    assert out.count("interrupted: saved") == 1, out
    step = json.loads((tmp_path / "run" / "state.json").read_text())["step"]
    rc, out = hosts.mpi(["-m", "tbp", "train", "--out", "run", "--resume", "--max-iters", step + 3, "-q"], tmp_path)
    assert rc == 0, out
    assert losses(tmp_path / "run")[-1][0] == step + 3


def test_a_host_that_is_not_there_ends_the_launch(hosts, tmp_path, prepared):
    """One of the two hosts named does not exist: the launcher cannot start its rank, the job
    ends in seconds, and no rank wrote anything."""
    missing = hosts.ips[1].rsplit(".", 1)[0] + ".99"
    exe = _mpiexec()
    cmd = hosts.command(exe, ["-m", "tbp", "train", "--data", prepared, "--out", "run", "--max-iters", 3, *TINY])
    cmd[cmd.index("-hosts") + 1] = f"{hosts.ips[0]},{missing}"
    start = time.monotonic()
    rc, out = job(cmd, tmp_path, {**_env(exe), **hosts.ENV}, timeout=60)
    assert rc != 0, out
    assert time.monotonic() - start < 30, out
    # the launcher names the address; mpiexec, tearing the job down, can drop that line and say
    # only that it could not launch the proxy (seen once in CI): either names the launch as the cause
    assert (f"no network namespace holds the address {missing}" in out or "Launch proxy failed" in out), out
    assert not (tmp_path / "run" / "state.json").exists()
