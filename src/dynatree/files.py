"""Writing a file so that no reader ever sees half of it.

Caches (converted checkpoints, q4 rows, file digests), datastores, training data, checkpoints and
bench results are all written the same way: into a temporary name beside the destination, then moved
onto it in one step (`os.replace`, atomic on one file system). The temporary name carries the process
and thread, so two writers of the same file (two processes converting the same GGUF, say) never write
into one temporary; the last to finish wins with a whole file either way."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temporary_beside(path: Path, suffix: str = "") -> Path:
    """A name in `path`'s directory that no other process or thread writing `path` uses; `suffix` is
    appended for writers that insist on an extension (numpy adds `.npy` to names without it)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}{suffix}")


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
