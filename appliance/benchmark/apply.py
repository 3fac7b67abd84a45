"""``appliance benchmark --apply``: write the advised settings into ``appliance.yaml``, changing nothing else.

The file is edited as a ``ruamel.yaml`` round trip, so every comment, blank line, key order, quote and flow list
stays. :func:`advised_text` first finds the dump settings (indents, how null is spelled) that reproduce the file
exactly, refuses what it cannot edit in place, sets each dotted key (a missing one at the end of its section, the
section at the end of the file when it is missing), checks that only the advised keys' lines changed, that every
comment is still there and that the result is a valid config (:func:`~appliance.config.validate.parse_config`).

A result file is untrusted input (it may have been crafted): :func:`pending_changes` refuses an entry whose key is
not one the advice sets, and :func:`apply_changes` (what both ``--apply`` and the admin page's "Apply advice"
write with) refuses any key outside :data:`~appliance.benchmark.advice.ADVISED` or a value outside its range
(:class:`AdviceRefused`). It then writes the file atomically (:func:`write_atomic`), or refuses with
:class:`ConfigNotWritable` when this process may not (a read-only file system, as ``/etc/appliance`` is to the
shipped systemd unit: :func:`root_command` says what to run instead) or should not (a hard-linked file).
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import io
import logging
import os
import re
import shlex
import signal
import stat
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark, YAMLError
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.tokens import CommentToken

from appliance.benchmark.advice import Recommendation, changes, current_settings, key_refusal, refusal
from appliance.config import schema
from appliance.config.types import Config
from appliance.config.validate import ConfigInvalid, load_config, parse_config

log = logging.getLogger(__name__)

WIDTH = 1 << 16
"""Wide enough that no line is ever re-wrapped."""
INDENTS: tuple[tuple[int, int, int], ...] = tuple(
    (mapping, offset + 2, offset) for mapping in (2, 4, 3) for offset in (2, 0, 4, 1, 3) if offset <= mapping
)
"""(mapping, sequence, offset) indents tried, in order, until the file round-trips unchanged."""
NULL_SPELLINGS = ("null", "", "~")
"""How a null value may be spelled in the file (tried in order, as the indents)."""
SCALARS = (bool, int, float, str)
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
"""Held off while :func:`write_atomic`'s temporary file exists: one arriving then takes effect once it is gone."""
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
"""The errors of a write this process may not do (read-only file system, permissions, the immutable attribute)."""
COMMENT = re.compile(r"(?:^|\s)(#.*)$")


def _null_representer(spelling: str) -> type[RoundTripRepresenter]:
    """A round-trip representer of its own (``add_representer`` changes a class for every YAML of the process)
    that spells null ``spelling``; "" is ruamel's own (empty as a mapping value)."""
    if spelling == "":
        return RoundTripRepresenter

    def represent_null(representer: RoundTripRepresenter, data: None) -> Any:
        return representer.represent_scalar("tag:yaml.org,2002:null", spelling)

    class NullSpelled(RoundTripRepresenter):
        pass

    NullSpelled.add_representer(type(None), represent_null)
    return NullSpelled


NULL_REPRESENTERS = {spelling: _null_representer(spelling) for spelling in NULL_SPELLINGS}


class AdviceRejected(Exception):
    """A change that cannot be written: an unknown key, a value the config would refuse, a file that cannot be
    edited in place. ``message`` names the key (or the file) and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AdviceRefused(AdviceRejected):
    """A change that is not advice: ``key`` is not one the advice sets, or its value is not one the advice could
    have produced (:data:`~appliance.benchmark.advice.ADVISED`). Nothing is written."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


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


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_changes` did: the file's text before and after, their unified diff ("" when nothing
    changed, and then nothing was written) and the keys whose value changed."""

    old_text: str
    new_text: str
    diff: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class _Edit:
    text: str
    keys: tuple[str, ...]
    models: int  # the configured models


def advised_text(text: str, changes: Mapping[str, Any], *, source: Path | None = None) -> str:
    """``text`` (an ``appliance.yaml``) with each dotted key of ``changes`` set to its value, nothing else changed.

    ``source`` is the file's path, so relative paths resolve as they do for the daemon (model files need not
    exist). Raises :class:`AdviceRejected` when a change cannot be made or would make the config invalid."""
    return _edit(text, changes, source).text


def unified_diff(old: str, new: str, path: str | os.PathLike[str]) -> str:
    """The unified diff from ``old`` to ``new`` with ``a/<name>`` and ``b/<name>`` headers ("" when equal)."""
    name = Path(path).name
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                 fromfile=f"a/{name}", tofile=f"b/{name}")
    parts = []
    for line in lines:
        if line.endswith("\n"):
            parts.append(line)
        else:
            parts.append(line + "\n\\ No newline at end of file\n")
    return "".join(parts)


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
                                f"names symlinks to it, or set the advised keys by hand", read_only=False)
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


def root_command(result: str | os.PathLike[str], config: str | os.PathLike[str],
                 socket: str | os.PathLike[str] | None = None) -> str:
    """The command that applies ``result`` to ``config`` as root, for a config this process may not write (the
    shipped systemd unit keeps ``/etc/appliance`` read-only to the service): this installation's ``appliance``
    (beside its Python; ``appliance`` from the PATH when there is none) under sudo; ``socket``: the running
    appliance it then tells to reload."""
    program = Path(sys.executable).with_name("appliance")
    words = ["sudo", str(program) if program.is_file() else "appliance", "benchmark", "--result",
             os.path.abspath(result), "--apply", "--config", os.path.abspath(config)]
    if socket is not None:
        words += ["--socket", os.path.abspath(socket)]
    return shlex.join(words)


def plan_changes(path: str | os.PathLike[str], changes: Mapping[str, Any]) -> Applied:
    """What :func:`apply_changes` would write, nothing written: the config at ``path`` read and edited
    (:func:`advised_text`), every change checked as advice (:func:`check_advice`), and the file checked writable
    (:func:`check_writable`) when something changes."""
    source = Path(path)
    try:
        old_text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AdviceRejected(f"{source}: not UTF-8 text ({exc})") from None
    for key, value in changes.items():  # a key the advice never sets is named as such, whatever its value
        _check_change(key, value)
        problem = key_refusal(key)
        if problem is not None:
            raise AdviceRefused(key, f"{problem}; nothing applied")
    edit = _edit(old_text, changes, source)  # a value the config refuses is refused as such (CONFIG_INVALID)
    check_advice(changes, edit.models)
    diff = unified_diff(old_text, edit.text, source)
    if diff:
        check_writable(source)
    return Applied(old_text, edit.text, diff, edit.keys)


def apply_changes(path: str | os.PathLike[str], changes: Mapping[str, Any]) -> Applied:
    """Read the config at ``path``, set ``changes`` (:func:`plan_changes`: advised keys only, each within the
    advice's range), and write it back atomically (:func:`write_atomic`); nothing is written when no value
    changes (``diff`` is "")."""
    planned = plan_changes(path, changes)
    if planned.diff:
        write_atomic(path, planned.new_text)
    return planned


def check_advice(changes: Mapping[str, Any], models: int) -> None:
    """Refuse (:class:`AdviceRefused`) a change that is not advice: a key outside
    :data:`~appliance.benchmark.advice.ADVISED`, or a value its advice cannot give (``models``: how many models the
    config has)."""
    for key, value in changes.items():
        problem = refusal(key, value, models)
        if problem is not None:
            raise AdviceRefused(key, f"{problem}; nothing applied")


# --- the edit --------------------------------------------------------------------------------------------------------


def _edit(text: str, changes: Mapping[str, Any], source: Path | None) -> _Edit:
    file = "the config" if source is None else str(source)
    for key, value in changes.items():
        _check_change(key, value)
    models = len(_validate(text, source, file, {}).models)
    if not changes:
        return _Edit(text, (), models)
    final_newline = text.endswith("\n") or not text
    body = text if final_newline else text + "\n"
    yaml, root = _round_trip(body, file)
    changed: list[str] = []
    allowed: set[int] = set()  # lines (0-based) of the original that may change
    added = False
    if root is None:  # nothing but comments (or nothing): the settings go below them
        root = CommentedMap()
        for key, value in changes.items():
            _set(root, key, value, allowed)
            changed.append(key)
        new_body = body + _dump(yaml, root)
        added = True
    else:
        for key, value in changes.items():
            outcome = _set(root, key, value, allowed)
            if outcome is not None:
                changed.append(key)
                added = added or outcome == "added"
        if not changed:
            return _Edit(text, (), models)
        new_body = _dump(yaml, root)
    new_text = new_body if final_newline else new_body.removesuffix("\n")
    _check_confined(body, new_body, allowed, added, file)
    _check_comments_kept(body, new_body, file)
    _validate(new_text, source, file, changes)
    return _Edit(new_text, tuple(changed), models)


def _check_change(key: Any, value: Any) -> None:
    """A change names a known setting outside ``models[]`` and gives it a plain YAML value."""
    if not isinstance(key, str) or key not in schema.BY_KEY:
        raise AdviceRejected(f"{key!r}: not a config key (see docs/configuration.md)")
    if "[]" in key:
        raise AdviceRejected(f"{key}: a per-model key; the advice can only set keys outside models[]")
    items = value if isinstance(value, list | tuple) else [value]
    if not all(item is None or isinstance(item, SCALARS) for item in items):
        raise AdviceRejected(f"{key}: {value!r} is not a YAML scalar or a list of scalars")


def _validate(text: str, source: Path | None, file: str, changes: Mapping[str, Any]) -> Config:
    """The config ``text`` holds; refuse it unless it is valid, naming the changed key a problem is about."""
    try:
        return parse_config(text, source=source, check_files=False)
    except ConfigInvalid as exc:
        if not changes:
            raise AdviceRejected(f"{file} is not a valid config before any change; fix it first: {exc}") from None
        for problem in exc.problems:
            for key, value in changes.items():
                if problem.path == key or problem.path.startswith(key + "."):
                    raise AdviceRejected(f"{key}: {schema.show(_plain(value))} would make {file} invalid: "
                                         f"{problem.message}") from None
        raise AdviceRejected(f"the advised changes would make {file} invalid: {exc}") from None


def _round_trip(text: str, file: str) -> tuple[YAML, Any]:
    """A YAML set up to dump ``text`` back unchanged, and the loaded document; :class:`AdviceRejected` when no
    tried setting reproduces the file (it must then be edited by hand)."""
    closest: tuple[int, str] | None = None
    loader = _yaml(INDENTS[0], NULL_SPELLINGS[0])
    try:
        root = loader.load(text)
    except YAMLError as exc:
        raise AdviceRejected(f"{file}: YAML the editor cannot read: {exc}") from None
    if root is not None and not isinstance(root, CommentedMap):
        raise AdviceRejected(f"{file}: the top level must be a mapping of settings")
    if root is None:
        return loader, None
    for indents in INDENTS:
        for null in NULL_SPELLINGS:
            yaml = _yaml(indents, null)
            dumped = _dump(yaml, root)
            if dumped == text:
                return yaml, root
            line = _first_difference(text, dumped)
            if closest is None or line > closest[0]:
                closest = (line, text.splitlines()[line] if line < len(text.splitlines()) else "")
    line, content = closest if closest is not None else (0, "")
    raise AdviceRejected(f"{file}: cannot edit it without rewriting lines the advice does not touch (line "
                         f"{line + 1}: {content.strip()!r} would change); set the advised keys by hand")


def _yaml(indents: tuple[int, int, int], null: str) -> YAML:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = WIDTH
    mapping, sequence, offset = indents
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    yaml.Representer = NULL_REPRESENTERS[null]
    return yaml


def _dump(yaml: YAML, root: Any) -> str:
    stream = io.StringIO()
    yaml.dump(root, stream)
    return stream.getvalue()


def _first_difference(old: str, new: str) -> int:
    """The 0-based index of the first line where ``old`` and ``new`` differ."""
    old_lines = old.splitlines()
    new_lines = new.splitlines()
    for index, (before, after) in enumerate(zip(old_lines, new_lines, strict=False)):
        if before != after:
            return index
    return min(len(old_lines), len(new_lines))


def _set(root: CommentedMap, key: str, value: Any, allowed: set[int]) -> str | None:
    """Set the dotted ``key`` in ``root``: "changed", "added", or None when it already holds ``value``. The lines
    of the original that may change are added to ``allowed``."""
    *sections, name = key.split(".")
    mapping = root
    for depth, section in enumerate(sections):
        if section not in mapping:
            _append(mapping, section, _chain([*sections[depth + 1:], name], value), separate=depth == 0)
            return "added"
        if mapping[section] is None:
            _fill(mapping, section, _chain([*sections[depth + 1:], name], value), allowed)
            return "added"
        if not isinstance(mapping[section], CommentedMap):
            where = ".".join(sections[: depth + 1])
            raise AdviceRejected(f"{key}: cannot set it: {where} in the file is not a mapping")
        mapping = mapping[section]
    if name not in mapping:
        if mapping.fa.flow_style() and mapping.lc.line is not None:
            allowed.add(mapping.lc.line)  # {a: 1} -> {a: 1, b: 2}: the one line changes
        _append(mapping, name, _node(value))
        return "added"
    existing = mapping[name]
    if _same(existing, value):
        return None
    position = _key_position(mapping, name)
    if position is None:
        raise AdviceRejected(f"{key}: its value is not written in its own section (merged from an anchor?); set it "
                             f"by hand")
    allowed.add(position[0])
    if isinstance(existing, CommentedSeq) and isinstance(value, list | tuple):
        for index in range(len(existing)):
            allowed.add(existing.lc.item(index)[0])
        _replace_items(existing, value)
    else:
        mapping[name] = _node(value)
    return "changed"


def _replace_items(sequence: CommentedSeq, value: Sequence[Any]) -> None:
    """Set the items of ``sequence`` to ``value`` one by one, in place: its flow style and each item's comment
    (``- 60   # high``) stay (a slice assignment drops them); extra items are added or removed at its end."""
    for index, item in enumerate(value[: len(sequence)]):
        sequence[index] = item
    del sequence[len(value):]
    sequence.extend(value[len(sequence):])


def _fill(mapping: CommentedMap, name: str, value: CommentedMap, allowed: set[int]) -> None:
    """Give the empty section ``name`` (``engine:`` with nothing under it, or ``engine: ~``) its first entries where
    it is: no blank line added; its line (``~`` dropped) keeps its end-of-line comment, and the comment lines that
    followed it (about what comes next) move below the new entries."""
    position = _key_position(mapping, name)
    if position is not None:
        allowed.add(position[0])
    mapping[name] = value
    slot = mapping.ca.items.get(name)
    token = slot[2] if slot and len(slot) > 2 else None
    if token is None:
        return
    keep, move = _split_trailing(token.value, 0 if position is None else position[1])
    if not move:
        return
    token.value = keep
    holder, last = _last_entry(value)
    holder.ca.items[last] = [None, None, CommentToken(move, token.start_mark, None), None]


def _chain(names: list[str], value: Any) -> CommentedMap:
    """``value`` under nested mappings: ``["engine", "threads"]`` -> ``{engine: {threads: value}}``."""
    node = _node(value)
    for name in reversed(names):
        parent = CommentedMap()
        parent[name] = node
        node = parent
    return node


def _node(value: Any) -> Any:
    """A new value: a list becomes a flow sequence (``[60, 30]``)."""
    if not isinstance(value, list | tuple):
        return value
    sequence = CommentedSeq(value)
    sequence.fa.set_flow_style()
    return sequence


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


def _same(existing: Any, value: Any) -> bool:
    """The file already holds ``value`` (``1`` and ``1.0`` are the same number; ``true`` is not ``1``)."""
    if _kind(existing) != _kind(value):
        return False
    if _kind(value) == "list":
        return len(existing) == len(value) and all(map(_same, existing, value))
    return bool(existing == value)


def _append(mapping: CommentedMap, name: str, value: Any, *, separate: bool = False) -> None:
    """Add ``name`` at the end of ``mapping``. The blank lines and comments that followed its last entry (before
    what comes next) move below the new entry, so it lands inside the section, not after them. ``separate``: a
    blank line above it (a new section)."""
    token = _trailing_token(mapping)
    column = _key_column(mapping)
    had_entries = len(mapping) > 0
    mapping[name] = value
    keep, move = ("", "") if token is None else _split_trailing(token.value, column)
    if separate and had_entries:
        mapping.ca.items[name] = [None, [CommentToken("\n", CommentMark(0), None)], None, None]
    if not move:
        return
    token.value = keep
    holder, last = _last_entry(mapping)
    holder.ca.items[last] = [None, None, CommentToken(move, token.start_mark, None), None]


def _key_position(mapping: CommentedMap, name: Any) -> tuple[int, int] | None:
    """(line, column), 0-based, where the file writes ``name`` in ``mapping``; None when it does not."""
    try:
        return mapping.lc.key(name)
    except KeyError:
        return None


def _key_column(mapping: CommentedMap) -> int:
    """The column the file's keys of ``mapping`` start at (0 when it has none from the file)."""
    for key in mapping:
        position = _key_position(mapping, key)
        if position is not None:
            return position[1]
    return 0


def _last_entry(mapping: CommentedMap) -> tuple[CommentedMap, Any]:
    """The mapping and key of the last scalar or flow entry reached by following the last keys of ``mapping``."""
    last = next(reversed(mapping))
    value = mapping[last]
    if isinstance(value, CommentedMap) and len(value) and not value.fa.flow_style():
        return _last_entry(value)
    return mapping, last


def _trailing_token(node: Any) -> CommentToken | None:
    """The comment token after the last entry of ``node`` (followed into nested block collections)."""
    if isinstance(node, CommentedMap) and len(node):
        last = next(reversed(node))
        slot = node.ca.items.get(last)
        if slot and len(slot) > 2 and slot[2] is not None:
            return slot[2]
        return _trailing_token_of_value(node[last])
    if isinstance(node, CommentedSeq) and len(node):
        slot = node.ca.items.get(len(node) - 1)
        if slot and slot[0] is not None:
            return slot[0]
        return _trailing_token_of_value(node[-1])
    return None


def _trailing_token_of_value(value: Any) -> CommentToken | None:
    if isinstance(value, CommentedMap | CommentedSeq) and not value.fa.flow_style():
        return _trailing_token(value)
    return None


def _split_trailing(comment: str, column: int) -> tuple[str, str]:
    """(what stays with the last entry, what moves below a new one) of a trailing comment's text: the entry's own
    line and the comment lines indented deeper than ``column`` right under it stay."""
    first, newline, rest = comment.partition("\n")
    keep = [first + newline]
    lines = rest.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.lstrip(" ")
        if not stripped.startswith("#") or len(line) - len(stripped) <= column:
            break
        keep.append(line)
        index += 1
    moved = "".join(lines[index:])
    if not moved:
        return comment, ""
    return "".join(keep), "\n" + moved


def _check_confined(old: str, new: str, allowed: set[int], added: bool, file: str) -> None:
    """Refuse an edit that changed lines of the original other than ``allowed`` (or inserted lines without a
    key being added)."""
    old_lines = old.splitlines()
    new_lines = new.splitlines()
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, i1, i2, _j1, _j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        touched = set(range(i1, i2))
        if tag == "insert" and (added or allowed & {i1 - 1, i1}):
            continue
        if touched and touched <= allowed:
            continue
        line = i1 if i1 < len(old_lines) else len(old_lines) - 1
        content = old_lines[line].strip() if old_lines else ""
        raise AdviceRejected(f"{file}: the edit would also change line {line + 1} ({content!r}); set the advised "
                             f"keys by hand")


def _comments(text: str) -> Counter[str]:
    """The comment of each line of ``text`` (from a ``#`` that starts the line or follows a space)."""
    found: Counter[str] = Counter()
    for line in text.splitlines():
        match = COMMENT.search(line)
        if match is not None:
            found[match.group(1).rstrip()] += 1
    return found


def _check_comments_kept(old: str, new: str, file: str) -> None:
    """Refuse an edit that lost a comment of the original: comments are the operator's."""
    lost = _comments(old) - _comments(new)
    if not lost:
        return
    comment = next(iter(lost))
    line = next(index for index, text in enumerate(old.splitlines()) if text.rstrip().endswith(comment))
    raise AdviceRejected(f"{file}: the edit would drop the comment {comment!r} (line {line + 1}); set the advised "
                         f"keys by hand")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


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


def recommendations_of(advice: Any) -> list[Recommendation]:
    """The recommendations of a result's ``advice`` (JSON); ValueError naming the entry when it is not a list of
    recommendations."""
    if not isinstance(advice, list | tuple):
        raise ValueError(f"the advice must be a list of entries, got {type(advice).__name__}")
    recommendations = []
    for index, entry in enumerate(advice):
        try:
            recommendations.append(Recommendation.from_dict(entry))
        except ValueError as exc:
            raise ValueError(f"advice entry {index + 1}: {exc}") from None
    return recommendations


def pending_changes(path: str | os.PathLike[str], advice: Any) -> dict[str, Any]:
    """What a saved result's ``advice`` entries change in the config at ``path`` as it is now (not as it was when
    the run measured it): ``appliance benchmark --apply`` and the admin page's Apply both write this. The result is
    untrusted: an entry whose key the advice never sets is refused (:class:`AdviceRefused`) even where it would change
    nothing; the values are checked when written (:func:`apply_changes`). A file the config loader refuses raises
    :class:`AdviceRejected`; advice that is not a list of recommendations, ValueError."""
    given = recommendations_of(advice)
    try:
        current = current_settings(load_config(path, check_files=False))
    except ConfigInvalid as exc:
        raise AdviceRejected(f"{path} is invalid now, nothing applied: {exc.problems[0]}") from None
    recommendations = []
    for index, recommendation in enumerate(given):
        if recommendation.key is not None:
            problem = key_refusal(recommendation.key)
            if problem is not None:
                raise AdviceRefused(recommendation.key, f"advice entry {index + 1}: {problem}; nothing applied")
            recommendation = replace(recommendation, current=current[recommendation.key])
        recommendations.append(recommendation)
    return changes(recommendations)
