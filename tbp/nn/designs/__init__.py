"""The designs wing: one folder per design, each registering itself into the registry
(registry.py) when imported here -- the one line a new design adds outside its folder."""
from . import gqa  # noqa: F401,E402
from . import alibi  # noqa: F401,E402
