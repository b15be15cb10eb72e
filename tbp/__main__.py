"""`python -m tbp` is `tbp`."""
from .cli import main

main(prog_name="tbp")
