"""The command line: the only place that talks to the terminal (click, rich, tqdm). One module
per command; ``main`` (main.py) is the group they join, the ``tbp`` program."""
