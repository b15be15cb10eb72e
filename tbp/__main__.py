"""`python -m tbp` is `tbp`."""
from .cli.main import main

main(prog_name="tbp")
