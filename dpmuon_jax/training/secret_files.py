"""Files and directories only their owner can read (directories 0700, files 0600).

Checkpoints and release journals hold PRNG state: whoever reads it can
reconstruct the noise of every release made with it. Everything this module
creates is owner-only from the moment it exists (never created wider and
narrowed afterwards), whatever the process umask is.

* :func:`write_private_file`: one owner-only file, written atomically.
* :func:`private_open`: an owner-only file object (e.g. to append to a journal).
* :func:`make_private_dir`: an owner-only directory.
* :func:`private_umask`: umask 077 while a library (orbax) writes files itself.
* :func:`restrict_tree`: narrows an existing tree to owner-only.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, Any

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_PRIVATE_UMASK = 0o077

_UMASK_LOCK = threading.RLock()

_OPEN_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def _as_bytes(data: bytes | str) -> bytes:
  return data.encode("utf-8") if isinstance(data, str) else bytes(data)


def make_private_dir(path: str | os.PathLike) -> str:
  """Creates ``path`` (and missing parents) and makes ``path`` itself mode 0700.

  Missing parents get the default mode; only ``path`` is made owner-only (also
  when it already existed). Returns the absolute path.
  """
  path = os.path.abspath(os.fspath(path))
  os.makedirs(path, mode=PRIVATE_DIR_MODE, exist_ok=True)
  os.chmod(path, PRIVATE_DIR_MODE)
  return path


def private_open(
    path: str | os.PathLike, mode: str = "w", encoding: str | None = None
) -> IO[Any]:
  """Opens ``path`` for writing as an owner-only (0600) file.

  Args:
    path: the file; created with mode 0600, an existing file is narrowed to 0600.
    mode: ``"w"`` (truncate), ``"a"`` (append) or ``"x"`` (must not exist),
      optionally with ``"b"`` for bytes.
    encoding: text encoding (text modes; default UTF-8).
  """
  kind = mode.replace("b", "")
  if kind not in _OPEN_FLAGS or mode.count("b") > 1:
    raise ValueError(f"private_open mode must be w, a or x (optionally with b), got {mode!r}.")
  fd = os.open(os.fspath(path), _OPEN_FLAGS[kind] | getattr(os, "O_CLOEXEC", 0),
               PRIVATE_FILE_MODE)
  try:
    os.fchmod(fd, PRIVATE_FILE_MODE)
    if "b" in mode:
      return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding=encoding or "utf-8")
  except BaseException:
    os.close(fd)
    raise


def write_private_file(path: str | os.PathLike, data: bytes | str) -> str:
  """Writes ``data`` to ``path`` atomically as an owner-only (0600) file.

  The bytes go to a 0600 temporary file in the same directory, are flushed to
  disk and then renamed over ``path``: readers see the old file or the new
  one, never a partial write. Returns the absolute path.
  """
  path = os.path.abspath(os.fspath(path))
  directory, name = os.path.split(path)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")  # mode 0600
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(_as_bytes(data))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise
  return path


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
  """Adds 077 to the process umask for the duration of the block.

  For code that creates files itself (orbax, TensorStore), including from its
  own threads: run it, and wait for it to finish, inside the block. The umask
  is process-wide, so files that OTHER threads create meanwhile are owner-only
  too (never wider than they would otherwise be). Blocks entered from several
  threads are serialised, so the umask is always restored correctly.
  """
  with _UMASK_LOCK:
    previous = os.umask(_PRIVATE_UMASK)
    os.umask(previous | _PRIVATE_UMASK)
    try:
      yield
    finally:
      os.umask(previous)


def restrict_tree(path: str | os.PathLike) -> None:
  """Makes ``path`` and everything under it owner-only (dirs 0700, files 0600).

  Symbolic links are neither followed nor changed.
  """
  path = os.fspath(path)
  if os.path.islink(path):
    return
  os.chmod(path, PRIVATE_DIR_MODE if os.path.isdir(path) else PRIVATE_FILE_MODE)
  for root, dirs, files in os.walk(path):
    for name in dirs + files:
      child = os.path.join(root, name)
      try:
        mode = os.lstat(child).st_mode
      except FileNotFoundError:
        continue
      if stat.S_ISDIR(mode):
        os.chmod(child, PRIVATE_DIR_MODE)
      elif stat.S_ISREG(mode):
        os.chmod(child, PRIVATE_FILE_MODE)
