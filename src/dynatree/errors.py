"""The one exception type users see.

Anything the user can fix (bad option, missing model, prompt too long) raises
`DynaTreeError` with a message that fits on one line; the CLI prints it as
`dynatree: error: <message>` and exits with status 2, never with a traceback.
"""


class DynaTreeError(Exception):
    """A user-facing error with a one-line, actionable message."""
