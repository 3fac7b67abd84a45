"""``appliance benchmark --apply``: write the advised settings into ``appliance.yaml``, changing nothing else.

The file is edited as a ``ruamel.yaml`` round trip (:mod:`appliance.config.roundtrip`), so every comment, blank
line, key order, quote and flow list stays. :func:`advised_text` first finds the dump settings (indents, how null is
spelled) that reproduce the file exactly, refuses what it cannot edit in place, sets each dotted key (a missing one
at the end of its section, the section at the end of the file when it is missing), checks that only the advised
keys' lines changed, that every comment is still there and that the result is a valid config
(:func:`~appliance.config.validate.parse_config`).

A result file is untrusted input (it may have been crafted): :func:`pending_changes` refuses an entry whose key is
not one the advice sets, and :func:`apply_changes` (what both ``--apply`` and the admin page's "Apply advice"
write with) refuses any key outside :data:`~appliance.benchmark.advice.ADVISED` or a value outside its range
(:class:`AdviceRefused`). It then writes the file atomically (:func:`~appliance.config.filewrite.write_atomic`), or
refuses with :class:`ConfigNotWritable` when this process may not (a read-only file system, as ``/etc/appliance``
is to the shipped systemd unit: :func:`root_command` says what to run instead) or should not (a hard-linked file).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.tokens import CommentToken

from appliance.benchmark.advice import Recommendation, changes, current_settings, key_refusal, refusal
from appliance.config import schema
from appliance.config.filewrite import ConfigNotWritable, check_writable, write_atomic
from appliance.config.roundtrip import (
    EditRejected,
    append,
    check_comments_kept,
    check_confined,
    dump,
    key_position,
    last_entry,
    round_trip,
    split_trailing,
    unified_diff,
)
from appliance.config.types import Config
from appliance.config.validate import ConfigInvalid, load_config, parse_config

__all__ = ["AdviceRefused", "AdviceRejected", "Applied", "ConfigNotWritable", "advised_text", "apply_changes",
           "check_advice", "pending_changes", "plan_changes", "recommendations_of", "root_command", "unified_diff",
           "write_atomic"]

log = logging.getLogger(__name__)

SCALARS = (bool, int, float, str)

AdviceRejected = EditRejected
"""A change that cannot be written: an unknown key, a value the config would refuse, a file that cannot be edited in
place (the config edit's own refusal, :class:`~appliance.config.roundtrip.EditRejected`). ``message`` names the key
(or the file) and the problem."""


class AdviceRefused(AdviceRejected):
    """A change that is not advice: ``key`` is not one the advice sets, or its value is not one the advice could
    have produced (:data:`~appliance.benchmark.advice.ADVISED`). Nothing is written."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key




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
    yaml, root = round_trip(body, file)
    changed: list[str] = []
    allowed: set[int] = set()  # lines (0-based) of the original that may change
    added = False
    if root is None:  # nothing but comments (or nothing): the settings go below them
        root = CommentedMap()
        for key, value in changes.items():
            _set(root, key, value, allowed)
            changed.append(key)
        new_body = body + dump(yaml, root)
        added = True
    else:
        for key, value in changes.items():
            outcome = _set(root, key, value, allowed)
            if outcome is not None:
                changed.append(key)
                added = added or outcome == "added"
        if not changed:
            return _Edit(text, (), models)
        new_body = dump(yaml, root)
    new_text = new_body if final_newline else new_body.removesuffix("\n")
    check_confined(body, new_body, allowed, added, file)
    check_comments_kept(body, new_body, file)
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










def _set(root: CommentedMap, key: str, value: Any, allowed: set[int]) -> str | None:
    """Set the dotted ``key`` in ``root``: "changed", "added", or None when it already holds ``value``. The lines
    of the original that may change are added to ``allowed``."""
    *sections, name = key.split(".")
    mapping = root
    for depth, section in enumerate(sections):
        if section not in mapping:
            append(mapping, section, _chain([*sections[depth + 1:], name], value), separate=depth == 0)
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
        append(mapping, name, _node(value))
        return "added"
    existing = mapping[name]
    if _same(existing, value):
        return None
    position = key_position(mapping, name)
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
    position = key_position(mapping, name)
    if position is not None:
        allowed.add(position[0])
    mapping[name] = value
    slot = mapping.ca.items.get(name)
    token = slot[2] if slot and len(slot) > 2 else None
    if token is None:
        return
    keep, move = split_trailing(token.value, 0 if position is None else position[1])
    if not move:
        return
    token.value = keep
    holder, last = last_entry(value)
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






















def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value






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
