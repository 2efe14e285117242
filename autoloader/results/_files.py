"""A result's file on disk: where one can be written, and reading one safely."""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from autoloader._exceptions import InvalidInputError, ResultFileError
from autoloader.measure import format_bytes


def check_writable(path: Path) -> None:
    """Raise :class:`InvalidInputError` unless :meth:`TuneResult.save` can write at
    ``path``: the nearest of its folders that exists (``save()`` creates the others) is
    a folder this process can create a file in.

    Tried by creating a file there and removing it: permission bits do not tell (root
    writes past them, a read-only mount or ``/proc`` refuses root too). For a run that
    writes its result only at its end, so that a path it cannot write is refused before
    its first trial rather than after its whole budget.
    """
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InvalidInputError(
            f"cannot write the result at {str(path)!r}: {str(folder)!r} is not a folder. "
            "Give another path."
        )
    try:
        descriptor, probe = new_file(folder / "autoloader-probe")
    except OSError as error:
        raise InvalidInputError(
            f"cannot write the result at {str(path)!r}: creating a file in "
            f"{str(folder)!r} failed ({error.strerror or error}). Give a path in a folder "
            "you can write to."
        ) from None
    os.close(descriptor)
    probe.unlink(missing_ok=True)


def new_file(path: Path) -> tuple[int, Path]:
    """A new, empty file beside ``path``, hidden, opened for writing: its descriptor and
    path. Created with mode 0o666 as ``open()`` creates files, so that the umask sets
    its permissions (``tempfile.mkstemp`` would make it 0o600, and the result unreadable
    to the user's group)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for a temporary file beside {path}")


# NOTE [ Reading a result file ]
# load() is given a path, and a path may name something that is not a file a result
# was saved to: a FIFO (open() waits for a writer forever), a symlink to /dev/zero or
# another device (read() never ends, and memory grows until the process dies), a
# directory, or a file of gigabytes. The file is opened without blocking (O_NONBLOCK:
# a FIFO opens at once, with or without a writer), checked with fstat to be a regular
# file no larger than MAX_RESULT_BYTES, and read for at most that many bytes plus one,
# so a file growing under the read is caught too. A result of 10,000 trials is about
# 7 MiB. JSON nested deeper than Python's recursion limit raises RecursionError in
# json.loads (and would in any code that walks it): refused as malformed like any
# other bad JSON. Every refusal is a ResultFileError naming the path and what it is.
MAX_RESULT_BYTES = 64 * 1024**2


def read_result_json(path: Path) -> Any:
    """The JSON content of the result file at ``path``, read as ``NOTE [ Reading a result
    file ]`` says.

    Raises:
        ResultFileError: ``path`` cannot be opened, is not a regular file, is larger than
            ``MAX_RESULT_BYTES``, or does not hold JSON.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ResultFileError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        mode = os.fstat(descriptor)
        if not stat.S_ISREG(mode.st_mode):
            raise ResultFileError(
                f"{path} is {_file_kind(mode.st_mode)}, not a result file: a result is the "
                "regular JSON file TuneResult.save() writes; give the path of one"
            )
        if mode.st_size > MAX_RESULT_BYTES:
            raise ResultFileError(
                f"{path} is {format_bytes(mode.st_size)}, larger than any result file "
                f"(at most {format_bytes(MAX_RESULT_BYTES)}); give the path of the JSON "
                "file TuneResult.save() wrote"
            )
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            content = file.read(MAX_RESULT_BYTES + 1)
    except OSError as error:
        raise ResultFileError(f"cannot read {path}: {error.strerror or error}") from None
    finally:
        os.close(descriptor)
    if len(content) > MAX_RESULT_BYTES:
        raise ResultFileError(
            f"{path} grew past {format_bytes(MAX_RESULT_BYTES)} while it was read, larger "
            "than any result file; give the path of the JSON file TuneResult.save() wrote"
        )
    try:
        return json.loads(content)
    except RecursionError:
        raise ResultFileError(
            f"{path} is not a result: its JSON is nested deeper than any result's"
        ) from None
    except ValueError as error:  # UnicodeDecodeError included
        raise ResultFileError(f"{path} is not valid JSON: {error}") from None


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"
