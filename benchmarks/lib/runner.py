"""What the experiment scripts share: running tbp as a user would, in a subprocess."""
import subprocess
import sys


def tbp(*args) -> str:
    """stdout of `python -m tbp ARGS`; exits with tbp's stderr if the command fails."""
    done = subprocess.run([sys.executable, "-m", "tbp", *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"tbp {' '.join(map(str, args))} failed:\n{done.stderr}")
    return done.stdout


def builtin_data(work) -> str:
    """The built-in corpus prepared once into WORK/data, for runs that go side by side (each
    preparing it for itself, two would race to rename the same folder into place)."""
    from pathlib import Path
    data = Path(work) / "data"
    if not (data / "meta.json").is_file():
        tbp("prepare", "--out", data)
    return str(data)


def side_by_side(jobs: int, tasks: list, run, done) -> None:
    """run(*task) for every task, ``jobs`` at a time in threads (each a tbp subprocess), calling
    done(result) as each finishes. A task that fails is reported and the others go on: one
    failure must not leave the rest running with nobody to record them."""
    import concurrent.futures
    import traceback
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run, *task): task for task in tasks}
        for f in concurrent.futures.as_completed(futures):
            try:
                done(f.result())
            except BaseException:                       # SystemExit from tbp() included
                failed += 1
                print(f"{futures[f]} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if failed:
        sys.exit(f"{failed} of {len(tasks)} runs failed")
