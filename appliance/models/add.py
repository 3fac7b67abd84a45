"""``appliance models add FILE.gguf``: check a model file, place it under the first ``model_dirs`` folder and add its
entry to ``appliance.yaml``; a running appliance on that file picks it up with its hot reload.

In order, each step refusing with an :class:`~appliance.errors.ApplianceError` before anything is changed:

1. the config is read (``CONFIG_INVALID``) and the name is free (``MODEL_EXISTS``: no model has it as name or alias);
2. the file is a readable regular file (``BAD_REQUEST``, ``FORBIDDEN``) and the bounded GGUF reader accepts its header
   (``MODEL_LOAD_FAILED``);
3. the entry can be added (``CONFIG_INVALID``) and the config file written (``FORBIDDEN``, with the ``sudo`` command
   that would do it);
4. a trial load in a child process succeeds (``MODEL_LOAD_FAILED``: :mod:`appliance.engine.modelcheck`, what the
   daemon runs before it loads a new file);
5. the file is placed: kept where it is when it already lies inside a ``model_dirs`` folder, else a hard link
   (:data:`LINK`, the default: no second copy on disk; refused across file systems) or a copy (:data:`COPY`) in the
   first folder, under its own file name (a different file of that name there is refused);
6. the entry is written with the comment-keeping round trip (:mod:`appliance.models.entry`) and the atomic writer
   (:func:`appliance.config.filewrite.write_atomic`); a placed file is removed again when that write fails.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from appliance.config import schema
from appliance.config.filewrite import ConfigNotWritable, check_writable, write_atomic
from appliance.config.roundtrip import unified_diff
from appliance.config.validate import Config, ConfigInvalid, load_config
from appliance.daemon import policy
from appliance.engine import gguf_meta, modelcheck
from appliance.errors import ApplianceError
from appliance.models import entry

log = logging.getLogger(__name__)

Placement = Literal["link", "copy"]
LINK: Placement = "link"
COPY: Placement = "copy"
TRIAL_N_GPU_LAYERS = 0
"""The trial load checks the file on the CPU (it proves the file, not the GPU)."""

Trial = Callable[[Path, int], None]
"""Checks a model file at an ``n_ctx`` before it is added; raises ``MODEL_LOAD_FAILED``."""


def trial_load(path: Path, n_ctx: int) -> None:
    """The daemon's own check of a new model file: the bounded header reader, then a load in a child process."""
    modelcheck.check_model(path, n_ctx=n_ctx, n_gpu_layers=TRIAL_N_GPU_LAYERS)


@dataclass(frozen=True)
class Added:
    """What :func:`add_model` did: the model's ``name``, where its file is (``path``), how it got there
    (``placed``: ``kept``, ``linked`` or ``copied``), the config file written and its unified diff."""

    name: str
    path: Path
    placed: str
    config: Path
    diff: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "placed": self.placed, "config": str(self.config),
                "diff": self.diff, "notes": list(self.notes)}


def add_model(config_path: str | os.PathLike[str], file: str | os.PathLike[str], *, name: str | None = None,
              n_ctx: int | None = None, placement: Placement = LINK, data_dir: Path | None = None,
              trial: Trial = trial_load) -> Added:
    """Add the GGUF ``file`` to the config at ``config_path`` as model ``name`` (default: from the file name), with
    ``n_ctx`` when given (else the default), placed by ``placement``; ``data_dir`` replaces the file's (as
    ``appliance run --data-dir`` does: systemd's state folder). See the module docstring for the steps."""
    config_file = Path(config_path)
    config = read_config(config_file, data_dir)
    source = _readable(Path(file))
    name = entry.model_name_for(source.name) if name is None else _checked_name(name)
    taken = entry.name_owner(config, name)
    if taken is not None:
        raise taken
    if n_ctx is not None:
        _check_n_ctx(n_ctx)
    gguf_meta.read_model_shape(source)  # not a GGUF, or a hostile header: refused in milliseconds
    text = _text(config_file)
    target, placed = destination(config, source)
    folders = [Path(os.path.realpath(folder)) for folder in config.model_dirs]  # as destination() compares them
    written = entry.written_path(entry.raw_model_dirs(text, str(config_file)), folders, target)
    fields: dict[str, Any] = {"name": name, "path": written}
    if n_ctx is not None:
        fields["n_ctx"] = n_ctx
    new_text = entry.added_text(text, fields, source=config_file)
    _check_writable(config_file, source, name, n_ctx, placement, data_dir)
    trial(source, n_ctx or schema.BY_KEY["models[].n_ctx"].kind.convert(schema.BY_KEY["models[].n_ctx"].default))
    made = _place(source, target, placement) if placed is None else None
    try:
        write_atomic(config_file, new_text)
    except BaseException:
        if made is not None:
            with contextlib.suppress(OSError):
                made.unlink()
        raise
    how = placed or ("linked" if placement == LINK else "copied")
    log.info("model %s added to %s: %s (%s)", name, config_file, target, how)
    return Added(name, target, how, config_file, unified_diff(text, new_text, config_file), readable_notes(target))


def readable_notes(path: Path) -> tuple[str, ...]:
    """A note when other users may not read ``path`` (a hard link keeps the file's owner and mode): the appliance's
    own user (``appliance`` under systemd) must."""
    found = path.stat()
    if found.st_mode & stat.S_IROTH:
        return ()
    return (f"{path} is not readable by other users (mode {stat.S_IMODE(found.st_mode):04o}, owner uid "
            f"{found.st_uid}, gid {found.st_gid}): make sure the appliance's user may read it",)


def destination(config: Config, source: Path) -> tuple[Path, str | None]:
    """Where the model file goes, and ``"kept"`` when it stays where it is (it already lies inside a ``model_dirs``
    folder, or the same file is already there), else None (to be placed in the first folder)."""
    folders = [Path(os.path.realpath(folder)) for folder in config.model_dirs]
    if not folders:
        raise ApplianceError("BAD_REQUEST", "model_dirs is empty: there is no folder to put the model in",
                             {"setting": "model_dirs"})
    if policy.inside(source, folders):
        return source, "kept"
    target = folders[0] / source.name
    if target.exists() or target.is_symlink():
        if target.exists() and os.path.samefile(target, source):
            return target, "kept"
        raise ApplianceError("BAD_REQUEST", f"{target} is already there and is another file: rename the file, or "
                             f"remove that one", {"path": str(target), "file": str(source)})
    return target, None


def root_command(file: Path, config: Path, name: str, n_ctx: int | None, placement: Placement,
                 data_dir: Path | None) -> str:
    """The ``sudo appliance models add …`` that does this add as root (a config this user may not write)."""
    program = Path(sys.executable).with_name("appliance")
    words = ["sudo", str(program) if program.is_file() else "appliance", "models", "add", os.path.abspath(file),
             "--name", name]
    if n_ctx is not None:
        words += ["--n-ctx", str(n_ctx)]
    if placement == COPY:
        words.append("--copy")
    words += ["--config", os.path.abspath(config)]
    if data_dir is not None:
        words += ["--data-dir", os.path.abspath(data_dir)]
    return shlex.join(words)


def read_config(path: Path, data_dir: Path | None) -> Config:
    """The config at ``path`` (``data_dir`` replacing its own), or its ``CONFIG_INVALID``."""
    try:
        return load_config(path, data_dir=data_dir)
    except ConfigInvalid as exc:
        raise exc.error from None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApplianceError("CONFIG_INVALID", f"cannot read {path}: {exc}", {"file": str(path)}) from None


def _readable(file: Path) -> Path:
    """The model file, resolved: a regular file this process can read (a folder, device, FIFO or socket is refused)."""
    path = Path(os.path.realpath(file.expanduser()))
    try:
        found = path.stat()
    except FileNotFoundError:
        raise ApplianceError("BAD_REQUEST", f"no such file: {file}", {"file": str(file)}) from None
    except OSError as exc:
        raise ApplianceError("FORBIDDEN", f"cannot read {file}: {exc.strerror or exc}", {"file": str(file)}) from None
    if not stat.S_ISREG(found.st_mode):
        raise ApplianceError("BAD_REQUEST", f"{file} is not a regular file", {"file": str(file)})
    if not os.access(path, os.R_OK):
        raise ApplianceError("FORBIDDEN", f"cannot read {file}: permission denied (user id {os.geteuid()})",
                             {"file": str(file)})
    return path


def _checked_name(name: str) -> str:
    problem = schema.BY_KEY["models[].name"].check(name)  # type: ignore[misc]
    if problem is not None:
        raise ApplianceError("BAD_REQUEST", f"model name {name!r} {problem}", {"name": name[:80]})
    return name


def _check_n_ctx(n_ctx: int) -> None:
    setting = schema.BY_KEY["models[].n_ctx"]
    assert setting.minimum is not None and setting.maximum is not None
    if not setting.minimum <= n_ctx <= setting.maximum:
        raise ApplianceError("BAD_REQUEST", f"n_ctx must be {setting.minimum:g}..{setting.maximum:g} (got {n_ctx})",
                             {"n_ctx": n_ctx})


def _check_writable(config: Path, file: Path, name: str, n_ctx: int | None, placement: Placement,
                    data_dir: Path | None) -> None:
    try:
        check_writable(config)
    except ConfigNotWritable as exc:
        raise not_writable(exc, root_command(file, config, name, n_ctx, placement, data_dir)) from None


def not_writable(exc: ConfigNotWritable, command: str) -> ApplianceError:
    """``FORBIDDEN`` for a config this process may not write, with ``command`` (the add as root) unless this is root
    already (then the file system itself is read-only)."""
    message = f"cannot add the model: {exc.message}"
    details: dict[str, Any] = {"config": str(exc.path)}
    if exc.read_only and os.geteuid() != 0:
        message += f"; add it as root: {command}"
        details["command"] = command
    return ApplianceError("FORBIDDEN", message, details)


def _place(source: Path, target: Path, placement: Placement) -> Path:
    """Put ``source`` at ``target`` (a hard link, or a copy written beside it and renamed into place)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if placement == LINK:
            os.link(source, target)
        else:
            _copy(source, target)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise ApplianceError("BAD_REQUEST", f"cannot hard-link {source} into {target.parent}: another file "
                                 f"system; give --copy", {"file": str(source), "folder": str(target.parent)}) from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ApplianceError("FORBIDDEN", f"cannot put the model file in {target.parent}: "
                                 f"{exc.strerror or exc}", {"folder": str(target.parent)}) from None
        raise ApplianceError("BAD_REQUEST", f"cannot put the model file in {target.parent}: {exc.strerror or exc}",
                             {"folder": str(target.parent)}) from None
    return target


def _copy(source: Path, target: Path) -> None:
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(descriptor)
    try:
        shutil.copyfile(source, temporary)
        os.chmod(temporary, 0o644)
        os.link(temporary, target)  # never over a file that appeared meanwhile
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
