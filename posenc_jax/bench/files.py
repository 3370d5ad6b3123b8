"""A results folder's files: each written whole or not at all, read with errors that name the file and
the fix, and one writer at a time (:class:`FolderLock`, the file ``.lock``).

:func:`write_text` and :func:`write_json` replace a file through a temporary one, so a full disk or
a kill leaves the previous file readable; :func:`read_json` reads one back; :func:`check_writable`
fails before any training when a folder cannot hold results.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import pathlib
import socket
import warnings

__all__ = ["FolderLock", "check_writable", "json_type", "read_json", "write_error", "write_json", "write_text"]


def check_writable(out: pathlib.Path) -> None:
    """Makes ``out`` and writes a file in it, so a path that cannot hold the results fails before
    any training, with the path and what to do."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; pass a folder for the results")
    probe = out / f".write-test.{os.getpid()}"  # two runs starting together do not share it
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"cannot write to --out {out} ({error.strerror or error}); choose a folder you can write to"
        ) from None


def json_type(value) -> str:
    """The JSON type of ``value`` as an error names it (``"integer"``, ``"object"``, ...)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


def _read_text(path: pathlib.Path, what: str) -> str:
    try:
        return path.read_text()
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder, not the {what}; move it away and run again") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text, not the {what}; restore it or run into a new --out") from None
    except OSError as error:
        raise ValueError(
            f"cannot read {path} ({error.strerror or error}); check the file and its permissions"
        ) from None


def read_json(path, what: str, *, required: bool = True, fix: str = "run the same command again to rewrite it"):
    """The JSON object in ``path`` (``what`` names it in errors), or ``{}`` when it is absent and
    not ``required``; a missing, unreadable or non-object file is a ValueError naming it and ``fix``."""
    path = pathlib.Path(path)
    if not path.exists():
        if required:
            raise ValueError(f"no {path.name} in {path.parent} ({what}); {fix}")
        return {}
    try:
        value = json.loads(_read_text(path, what))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON ({error.msg} at line {error.lineno}), not the {what}; {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {json_type(value)}, not the {what} (an object); {fix}")
    return value


def write_error(path: pathlib.Path, error: OSError) -> ValueError:
    """The one-line error for an OSError writing ``path`` (a full disk: free space), naming the file."""
    if error.errno == errno.ENOSPC:
        fix = "free space on its disk, then run the same command again: the rows written so far are kept"
    else:
        fix = "fix that, then run the same command again: the rows written so far are kept"
    return ValueError(f"cannot write {path} ({error.strerror or error}); {fix}")


def write_text(path, text: str) -> None:
    """Replaces ``path`` with ``text`` whole or not at all (a temporary file, then ``os.replace``);
    an OSError (a full disk) is a ValueError naming the file, the old file left as it was."""
    path = pathlib.Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with partial.open("w") as file:
            file.write(text)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise write_error(path, error) from error


def write_json(path, value) -> None:
    """Writes ``value`` as JSON into ``path`` whole or not at all (see :func:`write_text`)."""
    write_text(path, json.dumps(value, indent=1))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return False
    return True


class FolderLock:
    """One writer per results folder: the file ``<out>/.lock`` holds the writer's pid, host and
    start time while it runs.

    Taking a lock that a live process holds (its pid alive on this host, or any pid on
    another host, which cannot be checked from here) is a ValueError naming the folder and the
    holder; a stale lock (its pid gone from this host, or an unreadable file) is taken over
    with a warning. Released on leaving the ``with`` block, exceptions and KeyboardInterrupt
    included; a killed process leaves a stale lock, which the next run takes over.

    Example:
      >>> import tempfile
      >>> folder = pathlib.Path(tempfile.mkdtemp())
      >>> with FolderLock(folder):
      ...     (folder / ".lock").exists()
      True
      >>> (folder / ".lock").exists()
      False
    """

    def __init__(self, out):
        self.folder = pathlib.Path(out)
        self.path = self.folder / ".lock"
        self.mine = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def _holder(self) -> dict | None:
        """The lock's record; None when it vanished; ``{}`` when it cannot be read."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        ok = isinstance(holder, dict) and isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str)
        return holder if ok else {}

    def _create(self) -> bool:
        """Writes our record to a temporary file and links it in place: the lock appears whole, or
        not at all when one is there already."""
        partial = self.folder / f".lock.{os.getpid()}.partial"
        try:
            partial.write_text(json.dumps(self.mine))
            try:
                os.link(partial, self.path)
            except FileExistsError:
                return False
        except OSError as error:
            raise write_error(self.path, error) from error
        finally:
            partial.unlink(missing_ok=True)
        return True

    def acquire(self) -> None:
        host = socket.gethostname()
        self.mine = {
            "pid": os.getpid(),
            "host": host,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "token": os.urandom(8).hex(),
        }
        for _ in range(5):
            if self._create() and self._holder() == self.mine:
                return
            holder = self._holder()
            if holder is None or holder == self.mine:
                continue  # released meanwhile (or ours after all): try again
            since = f", since {holder.get('started')}" if holder.get("started") else ""
            if holder and holder["host"] != host:
                raise ValueError(
                    f"--out {self.folder} is being written by pid {holder['pid']} on host {holder['host']}{since}; "
                    f"wait for that run to end or use another --out (if it has ended, delete {self.path})"
                )
            if holder and _alive(holder["pid"]):
                raise ValueError(
                    f"--out {self.folder} is being written by another run (pid {holder['pid']}{since}); wait for "
                    f"it to end or use another --out (if pid {holder['pid']} is no posenc-bench run, delete "
                    f"{self.path})"
                )
            what = f"pid {holder['pid']} is no longer running" if holder else "it cannot be read"
            warnings.warn(f"taking over the stale lock {self.path} ({what})", stacklevel=3)
            self.path.unlink(missing_ok=True)
        raise ValueError(f"could not take the lock {self.path}: other runs keep taking it; use another --out")

    def release(self) -> None:
        """Removes the lock if it is still ours."""
        if self.mine is not None and self._holder() == self.mine:
            self.path.unlink(missing_ok=True)
        self.mine = None
