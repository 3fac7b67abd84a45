"""The config file replaced atomically (:func:`write_atomic`), or refused with :class:`ConfigNotWritable` when this
process may not write it (a read-only file system, as ``/etc/appliance`` is to the shipped systemd unit; permissions)
or should not (a hard-linked file). ``appliance benchmark --apply`` and ``appliance models add`` write with it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
"""Held off while :func:`write_atomic`'s temporary file exists: one arriving then takes effect once it is gone."""
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
"""The errors of a write this process may not do (read-only file system, permissions, the immutable attribute)."""


class ConfigNotWritable(PermissionError):
    """The config file cannot be replaced by this process (``read_only``: a read-only file system, the immutable
    attribute, permissions) or should not be (a file with more than one hard link). Nothing is written."""

    def __init__(self, path: Path, message: str, *, read_only: bool, error: int = errno.EACCES) -> None:
        super().__init__(error, message, str(path))
        self.path = path
        self.message = message
        self.read_only = read_only

    def __str__(self) -> str:
        return self.message


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace the file at ``path`` (through a symlink: its target) with ``text``: a temporary file in the same
    folder (``.<name>.<pid>.<random>.tmp``), written, flushed, fsynced, given the original's mode (and owner, where
    allowed), renamed over it, then the folder fsynced. On any failure the original is untouched and the temporary
    file removed; :data:`HELD_SIGNALS` wait until it is renamed or removed, so a SIGTERM leaves none either. A
    SIGKILL cannot be held off: the next write removes what it left (:func:`remove_stale_temporaries`).

    Refused (:class:`ConfigNotWritable`, nothing written) where the file or its folder is not writable by this
    process (:func:`check_writable`), and for a file with more than one hard link: the rename would leave its other
    names on the old text, and writing through it in place is not atomic (a crash mid-write leaves a half-written
    config under every name), so neither is done; the operator makes the other names symlinks, or edits by hand."""
    target = Path(os.path.realpath(path))
    try:
        original: os.stat_result | None = target.stat()
    except FileNotFoundError:
        original = None
    check_writable(target)
    try:
        with _signals_held():
            for stale in remove_stale_temporaries(target):
                log.warning("removed %s, the temporary file of an interrupted write of %s", stale, target)
            _replace(target, text, original)
    except OSError as exc:
        if exc.errno in NOT_WRITABLE:
            raise ConfigNotWritable(target, f"cannot write {target}: {exc.strerror or exc}", read_only=True,
                                    error=exc.errno) from exc
        raise


def _replace(target: Path, text: str, original: os.stat_result | None) -> None:
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp",
                                             dir=target.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8", newline="") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if original is not None:
            os.chmod(temporary, stat.S_IMODE(original.st_mode))
            _keep_owner(temporary, original)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_folder(target.parent)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Block :data:`HELD_SIGNALS` for this thread meanwhile; a pending one is delivered at the end."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse (:class:`ConfigNotWritable`) a write of ``path`` (through a symlink: its target) that
    :func:`write_atomic` would not or could not do: the file has more than one hard link, or it or its folder
    (where the temporary file goes) is not writable by this process."""
    target = Path(os.path.realpath(path))
    try:
        links = target.stat().st_nlink
    except FileNotFoundError:
        links = 0
    if links > 1:
        raise ConfigNotWritable(target, f"{target} has {links} hard links: replacing it would leave the other names "
                                f"with the old settings, and writing it in place is not atomic; make the other "
                                f"names symlinks to it, or make the change by hand", read_only=False)
    effective = os.access in os.supports_effective_ids
    if links and not os.access(target, os.W_OK, effective_ids=effective):
        raise ConfigNotWritable(target, f"{target} is not writable by this process ({_why_read_only(target)})",
                                read_only=True)
    if not os.access(target.parent, os.W_OK | os.X_OK, effective_ids=effective):
        raise ConfigNotWritable(target, f"{target}: its folder {target.parent} is not writable by this process "
                                f"({_why_read_only(target.parent)}), and the file is replaced through a new file "
                                f"there", read_only=True)


def _why_read_only(path: Path) -> str:
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return "a read-only file system"
    return f"user id {os.geteuid()}: its permissions or the immutable attribute"


def _temporary_name(name: str) -> re.Pattern[str]:
    """The names :func:`write_atomic` gives the temporary files of a file called ``name``: ``.<name>.<pid>.<8
    random>.tmp`` (``.<name>.<8 random>.tmp``: written by a version that did not name its pid)."""
    return re.compile(rf"\.{re.escape(name)}\.(?:(?P<pid>[0-9]{{1,10}})\.)?[a-z0-9_]{{8}}\.tmp")


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that writes of ``path`` left when killed (:func:`write_atomic`'s naming, written
    by a process that is gone, or by a version that did not name it); answers what was removed."""
    target = Path(os.path.realpath(path))
    pattern = _temporary_name(target.name)
    removed = []
    for entry in target.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or not stat.S_ISREG(entry.lstat().st_mode):
            continue
        pid = match.group("pid")
        if pid is not None and _running(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
            removed.append(entry)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's
        return True
    return True


def _keep_owner(path: str, original: os.stat_result) -> None:
    """Give ``path`` the original's owner and group where this process may (root editing a service's config must
    not leave it root's); elsewhere it is already the writer's own file."""
    if (original.st_uid, original.st_gid) == (os.geteuid(), os.getegid()):
        return
    with contextlib.suppress(PermissionError):
        os.chown(path, original.st_uid, original.st_gid)


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable; a file system that cannot sync a folder is let be."""
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)
