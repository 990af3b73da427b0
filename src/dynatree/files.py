"""Writing a file so that no reader ever sees half of it.

What other processes may read or write at the same time, or what a killed run must not leave half
written, goes this way: the caches (converted checkpoints' directory name, q4 rows, file digests),
datastores, distillation data and training checkpoints, and a bench's results.json. Into a temporary
name beside the destination, then moved onto it in one step (`os.replace`, atomic on one file
system). The temporary name carries the process id and random bytes, so two writers of the same file
(two processes converting the same GGUF, say, or two threads) never write into one temporary; the last
to finish wins with a whole file either way."""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temporary_beside(path: Path, suffix: str = "") -> Path:
    """A new name in `path`'s directory, which no other writer of `path` uses; `suffix` is
    appended for writers that insist on an extension (numpy adds `.npy` to names without it)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}-{secrets.token_hex(4)}{suffix}")


@contextmanager
def replaced_atomically(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path to write; when the block ends without error it replaces `path` in one
    step, and when it raises the temporary is removed and `path` is left as it was."""
    tmp = temporary_beside(path, suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """`path.write_text(text)`, but atomic (see the module's docstring)."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """`path.write_bytes(data)`, but atomic (see the module's docstring)."""
    with replaced_atomically(path) as tmp:
        tmp.write_bytes(data)
