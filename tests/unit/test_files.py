"""files.Reloaded: a value made from files is made again exactly when one changes, by
every way a file is rotated; a FIFO or a directory is refused without being opened."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extractedprism import files
from extractedprism.files import FileProblem, Reads, Reloaded

pytestmark = pytest.mark.timeout(10)


def reader(paths: list[Path], made: list[bytes]) -> Reloaded[bytes]:
    def make(reads: Reads) -> bytes:
        value = b"".join(reads.read(str(p), "test file") for p in paths)
        made.append(value)
        return value

    return Reloaded(make)


def test_made_once_until_a_file_changes_in_any_way(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"1")
    b.write_bytes(b"x")
    made: list[bytes] = []
    value = reader([a, b], made)
    assert value.get() == b"1x" and value.get() == b"1x" and value.generation == 1
    # Rewritten in place, same size, same mtime (ctime still moves).
    st = a.stat()
    a.write_bytes(b"2")
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert value.get() == b"2x" and value.generation == 2
    # Replaced by a rename (a new inode).
    (tmp_path / "b.new").write_bytes(b"y")
    os.replace(tmp_path / "b.new", b)
    assert value.get() == b"2y"
    # The kubelet's atomic writer: the name is a symlink into a directory that is swapped.
    (tmp_path / "d1").mkdir()
    (tmp_path / "d1" / "a").write_bytes(b"3")
    (tmp_path / "..data").symlink_to("d1")
    a.unlink()
    a.symlink_to(tmp_path / "..data" / "a")
    assert value.get() == b"3y"
    (tmp_path / "d2").mkdir()
    (tmp_path / "d2" / "a").write_bytes(b"4")
    (tmp_path / "..data.new").symlink_to("d2")
    os.replace(tmp_path / "..data.new", tmp_path / "..data")
    assert value.get() == b"4y"
    assert made == [b"1x", b"2x", b"2y", b"3y", b"4y"]


def test_a_problem_names_the_file_and_the_next_get_tries_again(tmp_path: Path) -> None:
    a = tmp_path / "a"
    made: list[bytes] = []
    value = reader([a], made)
    with pytest.raises(FileProblem, match=f"test file missing: {a}"):
        value.get()
    a.write_bytes(b"ok")
    assert value.get() == b"ok"
    a.unlink()
    with pytest.raises(FileProblem, match="missing"):
        value.get()


def test_a_fifo_or_directory_is_refused_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # an open() would wait for a writer forever
    with pytest.raises(FileProblem, match=f"test file unusable: {fifo}: not a regular file"):
        reader([fifo], []).get()
    with pytest.raises(FileProblem, match="is a directory"):
        reader([tmp_path], []).get()


@pytest.mark.parametrize(("raw", "reason"), [
    (b"", "empty"), (b" \n\t ", "empty"), (b"\xff\xfe", "not UTF-8 text"),
    (b"a\nb", "more than one line"), (b"a\rb", "more than one line"),
    ("tök".encode(), "contains a non-ASCII character"), (b"a\x00b", "contains a control character"),
])
def test_one_bearer_token_rule_for_the_probe_and_discovery(raw: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=f"^{reason}$"):
        files.bearer_token(raw)


def test_a_bearer_token_is_trimmed_like_client_go() -> None:
    assert files.bearer_token(b"  abc.def-1\tx \n") == "abc.def-1\tx"


def test_a_path_with_a_nul_byte_is_a_file_problem_naming_it() -> None:
    # os.stat() raises ValueError (naming nothing) for it; every reader of files.py (the
    # probe's credentials, discovery's kubeconfig and the files it names) gets the
    # FileProblem it handles instead.
    with pytest.raises(FileProblem) as exc:
        Reads().read("/etc/a\0b", "client key")
    assert str(exc.value) == "client key unusable: /etc/a\\x00b: the path contains a NUL byte"
