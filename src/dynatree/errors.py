"""The one exception type users see.

Anything the user can fix (bad option, missing model, prompt too long) raises
`DynaTreeError` with a message that fits on one line; the CLI prints it as
`dynatree: error: <message>` and exits with status 2, never with a traceback.
"""


class DynaTreeError(Exception):
    """A user-facing error with a one-line, actionable message."""


def check_out_dir(path) -> None:
    """An output directory must be a directory or not exist yet: checked before any slow work."""
    from pathlib import Path

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DynaTreeError(f"--out {str(path)!r} is an existing file, not a directory; give a directory")
    import os

    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise DynaTreeError(f"--out {str(path)!r}: {str(parent)!r} is a file, not a directory")
    nearest = path if path.exists() else parent
    if nearest is not None and not os.access(nearest, os.W_OK | os.X_OK):
        raise DynaTreeError(f"--out {str(path)!r}: {str(nearest)!r} is not writable")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when empty), for one-line errors."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
