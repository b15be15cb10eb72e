"""The command line: the only place that talks to the terminal (click, rich, tqdm)."""
from .main import main

__all__ = ["main"]
