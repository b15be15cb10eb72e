"""The designs wing: one folder per design, each registering itself into the registry
(registry.py) when imported here -- the one line a new design adds outside its folder."""
from . import attnres  # noqa: F401,E402  (first: the residual axis lists sum, attention)
from . import mta  # noqa: F401,E402  (first: the attention axis lists standard, mta, gqa)
from . import rope  # noqa: F401,E402  (before alibi: the positions axis lists learned, rope, alibi)
from . import gqa  # noqa: F401,E402
from . import alibi  # noqa: F401,E402
from . import flash  # noqa: F401,E402
from . import sparse  # noqa: F401,E402
from . import encdec  # noqa: F401,E402
from . import qknorm  # noqa: F401,E402
from . import rmsnorm  # noqa: F401,E402
from . import swiglu  # noqa: F401,E402
from . import relu2  # noqa: F401,E402
