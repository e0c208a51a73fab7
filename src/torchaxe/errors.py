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


#: The longest quoted message (of the user's own exception) in a one-line summary.
QUOTED_CHARS = 200


def first_line(message: object) -> str:
    """Another program's message for a one-line summary: its first non-empty line, cut
    to ``QUOTED_CHARS``, with " ..." when more followed (the full text is shown where
    it was raised, in its traceback)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if len(first) > QUOTED_CHARS:
        return first[: QUOTED_CHARS - 3].rstrip() + "..."
    return first + " ..." if len(lines) > 1 else first
