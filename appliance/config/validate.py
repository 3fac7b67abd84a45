"""Parse and validate ``appliance.yaml`` (SPEC C1-C2) against the schema in :mod:`appliance.config.schema`.

Pure: :func:`parse_config` takes text and returns a frozen :class:`Config`, or raises :class:`ConfigInvalid`
with every :class:`Problem` at once, each with its key path and 1-based line (from the YAML node marks). The
only IO is :func:`load_config` reading the file and the model-file existence check, which ``check_files``
turns off (False) or replaces (a ``Path -> bool`` callable). The config's dataclasses live in
:mod:`appliance.config.types` and :func:`diff` (hot reload, C3) in :mod:`appliance.config.diff`; both are
re-exported here, so ``from appliance.config.validate import Config, diff, ConfigDiff`` keeps working.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from appliance.config import schema
from appliance.config.diff import ConfigDiff, diff
from appliance.config.types import Config, EngineConfig, HttpConfig, ModelConfig, SocketConfig, TinySpec
from appliance.errors import ApplianceError
from appliance.config.schema import parse_size, render_docs, show

__all__ = ["Config", "ConfigDiff", "ConfigInvalid", "EngineConfig", "HttpConfig", "ModelConfig", "Problem",
           "SocketConfig", "TinySpec", "default_config", "diff", "load_config", "parse_config", "parse_size",
           "render_docs"]


# The dataclass for each schema section ("" = top level); its field names are the section's keys.
CLASSES: dict[str, type] = {"": Config, "socket": SocketConfig, "http": HttpConfig, "engine": EngineConfig,
                            "models": ModelConfig, "models[].generate_if_missing": TinySpec}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: ``path`` like ``models[1].n_ctx`` (``""``: the whole file)."""

    path: str
    line: int | None
    message: str
    file: str = "appliance.yaml"

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return ": ".join([where, *([self.path] if self.path else []), self.message])

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "message": self.message}


class ConfigInvalid(Exception):
    """The config is not valid; ``problems`` lists everything wrong, by line."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...], source: Path | None = None) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: (p.line is None, p.line or 0)))
        self.source = source
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def error(self) -> ApplianceError:
        """The P4 ``CONFIG_INVALID`` error; details ``{"source", "problems": [{path, line, message}, …]}``."""
        first = str(self.problems[0]) if self.problems else "invalid"
        message = first if len(self.problems) <= 1 else f"{len(self.problems)} problems; first: {first}"
        return ApplianceError("CONFIG_INVALID", message, {"source": None if self.source is None else str(
            self.source), "problems": [p.to_dict() for p in self.problems]})


_BAD: Any = type("Bad", (), {"__repr__": lambda self: "BAD"})()  # a value that failed (already reported)


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _violation(s: schema.Setting, v: Any, raw: Any) -> str | None:
    """Why ``v`` (converted from ``raw``) breaks ``s``'s choices, range or check, or None."""
    fmt = schema.format_size if s.kind is schema.SIZE else show
    got = f"(got {fmt(v) if s.kind is schema.SIZE else show(raw)})"
    if s.choices and v not in s.choices:
        return f"must be one of {', '.join(s.choices)} {got}"
    if isinstance(v, int | float) and s.minimum is not None and v < s.minimum:
        return f"must be ≥ {fmt(s.minimum)} {got}"
    if isinstance(v, int | float) and s.maximum is not None and v > s.maximum:
        return f"must be ≤ {fmt(s.maximum)} {got}"
    why = s.check(v) if s.check else None
    return None if why is None else f"{why} {got}"


def _unknown(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key.lower(), names, n=1, cutoff=0.6)
    elsewhere = [s.key for s in (*schema.SETTINGS, *schema.SECTIONS) if s.key.rpartition(".")[2] == key]
    hint = f" (did you mean '{close[0]}'?)" if close else f" (it belongs at '{elsewhere[0]}')" if elsewhere else ""
    return f"unknown key '{key}'{hint}"


class _Validator:
    """Walks the composed YAML node tree: values (defaults filled in, ``_BAD`` where invalid) and problems."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.lines: dict[str, int] = {}  # key path -> line of its value
        self._yaml = yaml.SafeLoader("")

    def report(self, path: str, where: Node | int | None, message: str) -> None:
        line = where.start_mark.line + 1 if isinstance(where, Node) else where
        self.problems.append(Problem(path, line, message, self.file))

    def mapping(self, node: Node | None, section: str, path: str) -> Any:
        """``{key: value}`` for ``section`` from a mapping ``node`` (None: absent, all defaults), or ``_BAD``."""
        settings, subs = schema.members(section)
        found: dict[str, tuple[Node, Node]] = {}
        if node is not None and not isinstance(node, MappingNode):
            self.report(path, node, "must be a mapping of keys to values")
            return _BAD
        own = {id(k) for k, _ in node.value} if node is not None else set()  # not merged in by "<<"
        try:
            self._yaml.flatten_mapping(node) if node is not None else None  # resolve "<<" merge keys
        except yaml.YAMLError as exc:
            self.report(path, node, f"bad merge key: {getattr(exc, 'problem', exc)}")
            return _BAD
        for knode, vnode in node.value if node is not None else []:
            key = knode.value if isinstance(knode, ScalarNode) else "?"
            where = f"{path}.{key}" if path else key
            if key in found and id(found[key][0]) not in own:  # a key given here overrides a merged one
                found[key] = (knode, vnode) if id(knode) in own else found[key]
            elif key in found:
                self.report(where, knode, f"duplicate key (first at line {found[key][0].start_mark.line + 1})")
            elif key in settings or key in subs:
                found[key] = (knode, vnode)
            else:
                self.report(where, knode, _unknown(key, [*settings, *subs]))
        out: dict[str, Any] = {}
        for name, s in settings.items():
            where = f"{path}.{name}" if path else name
            if name in found:
                self.lines[where] = found[name][1].start_mark.line + 1
                out[name] = self.value(s, found[name][1], where)
            elif s.required:
                self.report(where, node, f"required key '{name}' is missing")
                out[name] = _BAD
            else:
                out[name] = None if s.default is None else s.kind.convert(s.default)
        for name, sub in subs.items():
            out[name] = self.section(sub, found[name][1] if name in found else None, f"{path}.{name}".strip("."))
        return out

    def section(self, sub: schema.Section, node: Node | None, path: str) -> Any:
        if node is None or _is_null(node):
            return None if sub.optional else [] if sub.many else self.mapping(None, sub.key, path)
        if not sub.many:
            return self.mapping(node, sub.key, path)
        if not isinstance(node, SequenceNode):
            self.report(path, node, "must be a list (each item a mapping)")
            return _BAD
        return [self.mapping(item, sub.key, f"{path}[{i}]") for i, item in enumerate(node.value)]

    def value(self, s: schema.Setting, node: Node, where: str) -> Any:
        try:
            raw = self._yaml.construct_object(node, deep=True)
            if raw is None and s.nullable:
                return None
            if raw is None:
                raise ValueError("must not be empty" + ("" if s.required else f" (default: {show(s.default)})"))
            v = s.kind.convert(node.value if s.kind.text and isinstance(node, ScalarNode) else raw)
            why = _violation(s, v, raw)
            if why:
                raise ValueError(why)
            return v
        except (ValueError, yaml.YAMLError) as exc:
            self.report(where, node, str(exc) if isinstance(exc, ValueError) else f"unreadable value: {exc}")
            return _BAD


def _resolver(base: Path, data_dir: Path | None) -> Callable[[Path], Path | None]:
    """Absolute normalised paths: ``{data_dir}/…`` against ``data_dir`` (None when unknown), others ``base``."""
    def resolve(p: Path) -> Path | None:
        head, _, rest = str(p).partition(os.sep)
        if head == schema.DATA_DIR_PREFIX:
            return None if data_dir is None else Path(os.path.normpath(data_dir / rest))
        return Path(os.path.normpath(base / p))
    return resolve


def _build(cls: type, values: dict[str, Any], prefix: str, resolve: Callable[[Path], Any], **extra: Any) -> Any:
    """``cls(**values)``, sub-sections built recursively and paths resolved."""
    kwargs = dict(extra)
    for f in dataclasses.fields(cls):
        if f.name in extra:
            continue
        key, v = prefix + f.name, values[f.name]
        sub = schema.SECTION_BY_KEY.get(key)
        if sub is not None and sub.many:
            v = tuple(_build(CLASSES[key], item, sub.prefix, resolve) for item in v)
        elif sub is not None and v is not None:
            v = _build(CLASSES[key], v, sub.prefix, resolve)
        elif sub is None and schema.BY_KEY[key].kind.paths:
            v = tuple(map(resolve, v)) if isinstance(v, tuple) else resolve(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cross_checks(v: _Validator, values: dict[str, Any], resolve: Callable[[Path], Path | None],
                  exists: Callable[[Path], bool] | None) -> None:
    """Rules spanning keys: unique model names, model files exist, a non-loopback HTTP host needs a token."""
    first: dict[str, int] = {}
    for i, m in enumerate(values["models"] if isinstance(values["models"], list) else []):
        if m is _BAD:
            continue
        if m["name"] is not _BAD and m["name"] in first:
            v.report(f"models[{i}].name", v.lines.get(f"models[{i}].name"),
                     f"duplicate model name '{m['name']}' (first at models[{first[m['name']]}])")
        first.setdefault(m["name"], i)
        path = None if m["path"] is _BAD else resolve(m["path"])
        if exists is not None and path is not None and m["generate_if_missing"] is None and not exists(path):
            v.report(f"models[{i}].path", v.lines.get(f"models[{i}].path"),
                     f"no such file: {path} (or set generate_if_missing to create a demo model)")
    http = values["http"]
    if http is not _BAD and http["host"] is not _BAD and http["api_token"] is None and not _is_loopback(http["host"]):
        v.report("http.host", v.lines.get("http.host"), f"binding to '{http['host']}' (not loopback) requires "
                 "http.api_token")


def parse_config(text: str, *, source: Path | None = None, base_dir: Path | None = None,
                 check_files: bool | Callable[[Path], bool] = True) -> Config:
    """Validate ``text`` and return its :class:`Config`; raise :class:`ConfigInvalid` with all problems.

    Relative paths resolve against ``base_dir`` (default: ``source``'s folder, else the current folder).
    ``check_files``: True checks that model files exist (``Path.is_file``), a callable replaces that check,
    False skips it; a model with ``generate_if_missing`` is exempt.
    """
    file = "appliance.yaml" if source is None else str(source)
    base = Path(os.path.abspath(Path(base_dir if base_dir is not None else
                                     Path(source).parent if source is not None else ".").expanduser()))
    v = _Validator(file)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        detail = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise ConfigInvalid([Problem("", None if mark is None else mark.line + 1,
                                     f"YAML syntax error: {detail or exc}", file)], source) from None
    if root is not None and not _is_null(root) and not isinstance(root, MappingNode):
        raise ConfigInvalid([Problem("", root.start_mark.line + 1, "the top level must be a mapping of settings",
                                     file)], source)
    values = v.mapping(None if root is None or _is_null(root) else root, "", "")
    data_dir = None if values["data_dir"] is _BAD else _resolver(base, None)(values["data_dir"])
    if values["data_dir"] is not _BAD and data_dir is None:
        v.report("data_dir", v.lines.get("data_dir"), f"cannot be relative to {schema.DATA_DIR_PREFIX} itself")
    resolve = _resolver(base, data_dir)
    exists = (check_files if callable(check_files) else Path.is_file) if check_files else None
    _cross_checks(v, values, resolve, exists)
    if v.problems:
        raise ConfigInvalid(v.problems, source)
    return _build(Config, values, "", resolve, source=source, base_dir=base)


def load_config(path: str | os.PathLike[str], *, check_files: bool | Callable[[Path], bool] = True) -> Config:
    """Read and parse the file at ``path``; an unreadable file raises :class:`ConfigInvalid` too."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigInvalid([Problem("", None, f"cannot read the file: {exc}", str(source))], source) from None
    return parse_config(text, source=source, check_files=check_files)


def default_config(base_dir: str | os.PathLike[str]) -> Config:
    """Every setting at its default, no models; relative default paths resolve against ``base_dir``."""
    return parse_config("", base_dir=Path(base_dir), check_files=False)
