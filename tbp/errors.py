"""The one exception type the CLI turns into a single line and exit code 1."""


class TbpError(Exception):
    """A problem with the user's data, files or options: the message names the culprit."""
