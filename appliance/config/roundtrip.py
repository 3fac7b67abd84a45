"""Comment-keeping edits of an ``appliance.yaml``'s text: a ``ruamel.yaml`` round trip that keeps every comment, blank
line, key order, quote and flow list, and the checks that an edit changed nothing else.

:func:`round_trip` finds the dump settings (indents, how null is spelled) that reproduce a file exactly, or refuses a
file it cannot edit in place; :func:`append` adds an entry at the end of a mapping, inside its section (the comments
that followed the last entry move below the new one); :func:`check_confined` and :func:`check_comments_kept` refuse an
edit that changed other lines or lost a comment. ``appliance benchmark --apply`` (:mod:`appliance.benchmark.apply`)
and ``appliance models add`` (:mod:`appliance.models.add`) edit the config through it, and write it with
:func:`appliance.config.filewrite.write_atomic`.

Pure: text in, text out; every refusal is :class:`EditRejected`.
"""

from __future__ import annotations

import difflib
import io
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import CommentMark, YAMLError
from ruamel.yaml.representer import RoundTripRepresenter
from ruamel.yaml.tokens import CommentToken

WIDTH = 1 << 16
"""Wide enough that no line is ever re-wrapped."""
INDENTS: tuple[tuple[int, int, int], ...] = tuple(
    (mapping, offset + 2, offset) for mapping in (2, 4, 3) for offset in (2, 0, 4, 1, 3) if offset <= mapping
)
"""(mapping, sequence, offset) indents tried, in order, until the file round-trips unchanged."""
NULL_SPELLINGS = ("null", "", "~")
"""How a null value may be spelled in the file (tried in order, as the indents)."""
COMMENT = re.compile(r"(?:^|\s)(#.*)$")


class EditRejected(Exception):
    """An edit that cannot be made: a file that cannot be edited in place, a change that would touch other lines or
    drop a comment, a value the config would refuse. ``message`` names the file or key and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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


def round_trip(text: str, file: str) -> tuple[YAML, Any]:
    """A YAML set up to dump ``text`` back unchanged, and the loaded document; :class:`EditRejected` when no
    tried setting reproduces the file (it must then be edited by hand)."""
    closest: tuple[int, str] | None = None
    loader = yaml_for(INDENTS[0], NULL_SPELLINGS[0])
    try:
        root = loader.load(text)
    except YAMLError as exc:
        raise EditRejected(f"{file}: YAML the editor cannot read: {exc}") from None
    if root is not None and not isinstance(root, CommentedMap):
        raise EditRejected(f"{file}: the top level must be a mapping of settings")
    if root is None:
        return loader, None
    for indents in INDENTS:
        for null in NULL_SPELLINGS:
            yaml = yaml_for(indents, null)
            dumped = dump(yaml, root)
            if dumped == text:
                return yaml, root
            line = _first_difference(text, dumped)
            if closest is None or line > closest[0]:
                closest = (line, text.splitlines()[line] if line < len(text.splitlines()) else "")
    line, content = closest if closest is not None else (0, "")
    raise EditRejected(f"{file}: cannot edit it without rewriting lines the edit does not touch (line "
                         f"{line + 1}: {content.strip()!r} would change); make the change by hand")


def yaml_for(indents: tuple[int, int, int], null: str) -> YAML:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = WIDTH
    mapping, sequence, offset = indents
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    yaml.Representer = NULL_REPRESENTERS[null]
    return yaml


def dump(yaml: YAML, root: Any) -> str:
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


def append(mapping: CommentedMap, name: str, value: Any, *, separate: bool = False) -> None:
    """Add ``name`` at the end of ``mapping``. The blank lines and comments that followed its last entry (before
    what comes next) move below the new entry, so it lands inside the section, not after them. ``separate``: a
    blank line above it (a new section)."""
    token = _trailing_token(mapping)
    column = _key_column(mapping)
    had_entries = len(mapping) > 0
    mapping[name] = value
    keep, move = ("", "") if token is None else split_trailing(token.value, column)
    if separate and had_entries:
        mapping.ca.items[name] = [None, [CommentToken("\n", CommentMark(0), None)], None, None]
    if not move:
        return
    token.value = keep
    holder, last = last_entry(mapping)
    holder.ca.items[last] = [None, None, CommentToken(move, token.start_mark, None), None]


def append_item(sequence: CommentedSeq, item: CommentedMap, *, separate: bool = False) -> None:
    """Add the mapping ``item`` at the end of the block ``sequence`` (``models:``), as :func:`append` adds a key: the
    blank lines and comments that followed its last item (about what comes next) move below the new one.
    ``separate``: a blank line above it (the file separates its items so)."""
    token = _trailing_token(sequence)
    column = sequence.lc.item(0)[1] - 2 if len(sequence) else 0  # the "- " of its items
    keep, move = ("", "") if token is None else split_trailing(token.value, column)
    previous = sequence[-1] if len(sequence) else None
    if separate and isinstance(previous, CommentedMap) and len(previous) and not previous.fa.flow_style():
        if token is None:
            holder, last = last_entry(previous)
            token = CommentToken("\n", CommentMark(0), None)
            holder.ca.items[last] = [None, None, token, None]
            keep = "\n"
        keep += "\n"
    if token is not None:
        token.value = keep
    sequence.append(item)
    if move:
        assert token is not None
        holder, last = last_entry(item)
        holder.ca.items[last] = [None, None, CommentToken(move, token.start_mark, None), None]


def separated(sequence: CommentedSeq, text: str) -> bool:
    """Whether ``text`` (the file ``sequence`` was loaded from) has a blank line just above its last item."""
    if len(sequence) < 2:
        return False
    line = sequence.lc.item(len(sequence) - 1)[0]
    lines = text.splitlines()
    return 0 < line <= len(lines) and not lines[line - 1].strip()


def key_position(mapping: CommentedMap, name: Any) -> tuple[int, int] | None:
    """(line, column), 0-based, where the file writes ``name`` in ``mapping``; None when it does not."""
    try:
        return mapping.lc.key(name)
    except KeyError:
        return None


def _key_column(mapping: CommentedMap) -> int:
    """The column the file's keys of ``mapping`` start at (0 when it has none from the file)."""
    for key in mapping:
        position = key_position(mapping, key)
        if position is not None:
            return position[1]
    return 0


def last_entry(mapping: CommentedMap) -> tuple[CommentedMap, Any]:
    """The mapping and key of the last scalar or flow entry reached by following the last keys of ``mapping``."""
    last = next(reversed(mapping))
    value = mapping[last]
    if isinstance(value, CommentedMap) and len(value) and not value.fa.flow_style():
        return last_entry(value)
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


def split_trailing(comment: str, column: int) -> tuple[str, str]:
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


def check_confined(old: str, new: str, allowed: set[int], added: bool, file: str) -> None:
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
        raise EditRejected(f"{file}: the edit would also change line {line + 1} ({content!r}); make the change "
                             f"by hand")


def _comments(text: str) -> Counter[str]:
    """The comment of each line of ``text`` (from a ``#`` that starts the line or follows a space)."""
    found: Counter[str] = Counter()
    for line in text.splitlines():
        match = COMMENT.search(line)
        if match is not None:
            found[match.group(1).rstrip()] += 1
    return found


def check_comments_kept(old: str, new: str, file: str) -> None:
    """Refuse an edit that lost a comment of the original: comments are the operator's."""
    lost = _comments(old) - _comments(new)
    if not lost:
        return
    comment = next(iter(lost))
    line = next(index for index, text in enumerate(old.splitlines()) if text.rstrip().endswith(comment))
    raise EditRejected(f"{file}: the edit would drop the comment {comment!r} (line {line + 1}); make the change "
                         f"by hand")
