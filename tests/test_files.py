"""files.py: a file is replaced whole or not at all, and concurrent writers never share a temporary."""

import threading

import numpy as np
import pytest

from dynatree.files import replaced_atomically, temporary_beside, write_bytes_atomic, write_text_atomic


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    write_bytes_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replaced_atomically(path) as tmp:
            tmp.write_text("half of the ne")
            raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    with pytest.raises(KeyboardInterrupt):  # also when interrupted before the temporary exists
        with replaced_atomically(path):
            raise KeyboardInterrupt
    assert path.read_text() == "old"


def test_two_writers_use_two_temporaries_beside_the_file(tmp_path):
    path = tmp_path / "digest"
    names = [temporary_beside(path)]
    thread = threading.Thread(target=lambda: names.append(temporary_beside(path)))
    thread.start()
    thread.join()
    names.append(temporary_beside(path))
    assert len(set(names)) == 3 and all(n.parent == tmp_path and n.name.startswith("digest.tmp") for n in names)


def test_numpy_writes_to_the_temporary_it_is_given(tmp_path):
    """np.save appends .npy to a name without it: the suffix keeps the temporary the one replaced."""
    path = tmp_path / "tokens.npy"
    with replaced_atomically(path, suffix=".npy") as tmp:
        np.save(tmp, np.arange(5), allow_pickle=False)
    assert np.load(path).tolist() == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.npy"]
