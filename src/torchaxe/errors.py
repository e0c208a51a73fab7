"""The one error channel: a typed exception with a one-line message for the user.

The CLI turns it into a line on stderr and exit code 2; nothing else in the package
prints errors or calls ``sys.exit``.
"""


class TorchaxeError(Exception):
    """A problem the user can act on, described in one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
