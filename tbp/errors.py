"""tbp's error types: the ones a front end shows as one line, never a traceback.

TbpError: a problem with the user's data, files or environment; the message names the file
or value at fault (exit 1). ConfigError: an option value outside its declared range (exit 2,
a usage error, when it comes from the command line; a loader that reads it from a file
raises TbpError naming the file instead). Any other exception is a bug in tbp.
"""
from .nn.config import ConfigError

__all__ = ["TbpError", "ConfigError"]


class TbpError(Exception):
    """A problem with the user's data, files or options: the message names the culprit.

    ``everywhere``: raised alike on every rank of an MPI job (they all stop on their own, and
    only rank 0 speaks); otherwise one rank's failure ends the whole job."""

    everywhere = False
