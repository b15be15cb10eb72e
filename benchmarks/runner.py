"""What the experiment scripts share: running tbp as a user would, in a subprocess."""
import subprocess
import sys


def tbp(*args) -> str:
    """stdout of `python -m tbp ARGS`; exits with tbp's stderr if the command fails."""
    done = subprocess.run([sys.executable, "-m", "tbp", *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"tbp {' '.join(map(str, args))} failed:\n{done.stderr}")
    return done.stdout
