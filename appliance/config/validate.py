"""Parse and validate ``appliance.yaml`` (SPEC C1-C2) against the schema in :mod:`appliance.config.schema`.

Pure: :func:`parse_config` takes text and returns a frozen :class:`Config`, or raises :class:`ConfigInvalid`
with every :class:`Problem` at once, each with its key path and 1-based line (from the YAML node marks).

The only IO is :func:`load_config` reading the file and, when asked (``check_files``), the model-file existence
check. A missing model file does not make a config invalid: the appliance serves the other models and that one as
``missing`` (:mod:`appliance.config.modelfiles` lists them, with their lines); ``check_files`` makes it a problem.

The config's dataclasses live in :mod:`appliance.config.types` and :func:`diff` (hot reload, C3) in
:mod:`appliance.config.diff`; both are re-exported here, so ``from appliance.config.validate import Config, diff,
ConfigDiff`` keeps working.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    Event,
    NodeEvent,
    ScalarEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from appliance.config import schema, secrets
from appliance.config.diff import ConfigDiff, diff
from appliance.config.schema import parse_size, render_docs, show
from appliance.config.types import Config, EngineConfig, HttpConfig, ModelConfig, SocketConfig, TinySpec
from appliance.errors import ApplianceError

__all__ = [
    "Config",
    "ConfigDiff",
    "ConfigInvalid",
    "EngineConfig",
    "HttpConfig",
    "ModelConfig",
    "Problem",
    "SocketConfig",
    "TinySpec",
    "default_config",
    "diff",
    "load_config",
    "parse_config",
    "parse_size",
    "render_docs",
]

DEFAULT_FILE = "appliance.yaml"

MAX_CONFIG_BYTES = 1024 * 1024
"""A larger config file is refused before it is parsed."""
MAX_DEPTH = 32
"""Mappings and sequences nested deeper than this are refused (no recursion ever follows them)."""
MAX_ALIASES = 100
"""Alias uses (``*name``) in one file."""
MAX_NODES = 20_000
"""Nodes in the file with every alias expanded (what building the values would make): bounds alias bombs."""

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser and composer when PyYAML has them (a 1 MiB file in milliseconds), else the pure one."""

CLASSES: dict[str, type] = {
    "": Config,
    "socket": SocketConfig,
    "http": HttpConfig,
    "engine": EngineConfig,
    "models": ModelConfig,
    "models[].generate_if_missing": TinySpec,
}
"""The dataclass for each schema section (``""`` = top level); its field names are the section's keys."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: ``path`` like ``models[1].n_ctx`` (``""``: the whole file)."""

    path: str
    line: int | None
    message: str
    file: str = DEFAULT_FILE

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        if self.path:
            return f"{where}: {self.path}: {self.message}"
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "message": self.message}


def _line_order(problem: Problem) -> tuple[bool, int]:
    """Sort key: by line, problems without a line last."""
    return (problem.line is None, problem.line or 0)


class ConfigInvalid(Exception):
    """The config is not valid; ``problems`` lists everything wrong, by line."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...], source: Path | None = None) -> None:
        self.problems = tuple(sorted(problems, key=_line_order))
        self.source = source
        super().__init__("\n".join(str(problem) for problem in self.problems))

    @property
    def error(self) -> ApplianceError:
        """The P4 ``CONFIG_INVALID`` error; details ``{"source", "problems": [{path, line, message}, …]}``."""
        if not self.problems:
            message = "invalid"
        elif len(self.problems) == 1:
            message = str(self.problems[0])
        else:
            message = f"{len(self.problems)} problems; first: {self.problems[0]}"
        details = {
            "source": None if self.source is None else str(self.source),
            "problems": [problem.to_dict() for problem in self.problems],
        }
        return ApplianceError("CONFIG_INVALID", message, details)


class _Bad:
    """The value of a setting or section that failed validation (its problem is already reported)."""

    def __repr__(self) -> str:
        return "BAD"


_BAD: Any = _Bad()


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"


MAX_NUMBER_DIGITS = 30
"""A number written with more digits is refused before it is converted (no setting needs more than 20)."""
_TEXT_KINDS = (schema.STR, schema.PATH, schema.PATHS, schema.HOSTS, schema.ORIGINS, schema.ALIASES)
_NUMBER = re.compile(r"[-+]?[0-9_]*\.?[0-9_]*(?:[eE][-+]?[0-9]+)?[A-Za-z]*")


def _longest_number(node: Node) -> int:
    """The most digits in a number written as ``node`` or one of its items (``[4096, 2]``); 0 when none."""
    scalars = node.value if isinstance(node, SequenceNode) else [node]
    longest = 0
    for scalar in scalars:
        if isinstance(scalar, ScalarNode) and _NUMBER.fullmatch(scalar.value):
            longest = max(longest, sum(char.isdigit() for char in scalar.value))
    return longest


def _non_ascii_digit(node: Node) -> str | None:
    """The first digit of a scalar ``node`` that is not ASCII 0-9 (``²``, ``٣``), or None."""
    if not isinstance(node, ScalarNode) or not isinstance(node.value, str):
        return None
    for char in node.value:
        if char.isdigit() and not char.isascii():
            return char
    return None


def _line(node: Node) -> int:
    """The 1-based line where ``node`` starts."""
    return node.start_mark.line + 1


def _join(path: str, name: str) -> str:
    """The key path of ``name`` inside ``path`` (``""``: the top level)."""
    if path:
        return f"{path}.{name}"
    return name


def _violation(setting: schema.Setting, value: Any, raw: Any) -> str | None:
    """Why ``value`` (converted from ``raw``) breaks ``setting``'s choices, range or check, or None."""
    shown = setting.spell(value) if setting.kind is schema.SIZE else show(raw)  # a size as bytes, in binary units
    got = f"(got {shown})"
    if setting.choices and value not in setting.choices:
        return f"must be one of {', '.join(setting.choices)} {got}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number {got}"
    if isinstance(value, int | float):
        if setting.minimum is not None and value < setting.minimum:
            return f"must be ≥ {setting.spell(setting.minimum)} {got}"
        if setting.maximum is not None and value > setting.maximum:
            return f"must be ≤ {setting.spell(setting.maximum)} {got}"
    if setting.check is None:
        return None
    why = setting.check(value)
    if why is None:
        return None
    return f"{why} {got}"


def _unknown(key: str, names: list[str]) -> str:
    """The problem of an unknown ``key`` in a section whose known keys are ``names``, with a hint."""
    import difflib  # only a config with a mistake needs it: a serving process does not hold it

    close = difflib.get_close_matches(key.lower(), names, n=1, cutoff=0.6)
    if close:
        return f"unknown key '{key}' (did you mean '{close[0]}'?)"
    for known in (*schema.SETTINGS, *schema.SECTIONS):
        if known.name == key:
            return f"unknown key '{key}' (it belongs at '{known.key}')"
    return f"unknown key '{key}'"


@dataclass(frozen=True)
class _Refused:
    """Why a value was refused (the problem's message)."""

    message: str


class _Validator:
    """Walks the composed YAML node tree: values (defaults filled in, ``_BAD`` where invalid) and problems."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.lines: dict[str, int] = {}  # key path -> line of its value
        self._yaml = yaml.SafeLoader("")  # constructs values and resolves merge keys of single nodes

    def report(self, path: str, where: Node | int | None, message: str) -> None:
        """Record a problem at ``path``; ``where`` is its node, its line, or None (no line)."""
        line = _line(where) if isinstance(where, Node) else where
        self.problems.append(Problem(path, line, message, self.file))

    def mapping(self, node: Node | None, section: str, path: str) -> Any:
        """``{key: value}`` for ``section`` from a mapping ``node`` (None: absent, all defaults), or ``_BAD``."""
        if node is None:
            found: dict[str, tuple[Node, Node]] = {}
        elif not isinstance(node, MappingNode):
            self.report(path, node, "must be a mapping of keys to values")
            return _BAD
        else:
            found = self._keys(node, section, path)
            if found is None:
                return _BAD
        settings, subsections = schema.members(section)
        values: dict[str, Any] = {}
        for name, setting in settings.items():
            where = _join(path, name)
            if name in found:
                value_node = found[name][1]
                self.lines[where] = _line(value_node)
                values[name] = self.value(setting, value_node, where)
            elif setting.required:
                self.report(where, node, f"required key '{name}' is missing")
                values[name] = _BAD
            elif setting.default is None:
                values[name] = None
            else:
                values[name] = setting.kind.convert(setting.default)
        for name, sub in subsections.items():
            sub_node = found[name][1] if name in found else None
            values[name] = self.section(sub, sub_node, _join(path, name))
        return values

    def _keys(self, node: MappingNode, section: str, path: str) -> dict[str, tuple[Node, Node]] | None:
        """The known keys of ``node`` (merge keys resolved): name -> (key node, value node), or None if the
        merge keys are broken. Reports duplicate and unknown keys."""
        settings, subsections = schema.members(section)
        own = {id(key_node) for key_node, _ in node.value}  # keys written here, not merged in by "<<"
        try:
            self._yaml.flatten_mapping(node)  # puts the merged pairs first
        except yaml.YAMLError as exc:
            self.report(path, node, f"bad merge key: {getattr(exc, 'problem', exc)}")
            return None
        found: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else "?"
            where = _join(path, key)
            if key in found:
                first_node = found[key][0]
                if id(first_node) in own:
                    self.report(where, key_node, f"duplicate key (first at line {_line(first_node)})")
                elif id(key_node) in own:  # a key given here overrides a merged one
                    found[key] = (key_node, value_node)
            elif key in settings or key in subsections:
                found[key] = (key_node, value_node)
            else:
                self.report(where, key_node, _unknown(key, [*settings, *subsections]))
        return found

    def section(self, sub: schema.Section, node: Node | None, path: str) -> Any:
        """The value of the section ``sub``: a mapping's values, a list of them, None (optional, absent)."""
        if node is None or _is_null(node):
            if sub.optional:
                return None
            if sub.many:
                return []
            return self.mapping(None, sub.key, path)
        if not sub.many:
            return self.mapping(node, sub.key, path)
        if not isinstance(node, SequenceNode):
            self.report(path, node, "must be a list (each item a mapping)")
            return _BAD
        items = []
        for index, item in enumerate(node.value):
            items.append(self.mapping(item, sub.key, f"{path}[{index}]"))
        return items

    def value(self, setting: schema.Setting, node: Node, where: str) -> Any:
        """The converted value of ``setting`` from its ``node``, or ``_BAD`` (reported; a secret setting's problem
        never shows its value: :func:`appliance.config.secrets.hidden_value`)."""
        why = self._refusal(setting, node)
        if isinstance(why, _Refused):
            message = secrets.hidden_value(why.message) if setting.secret else why.message
            self.report(where, node, message)
            return _BAD
        return why

    def _refusal(self, setting: schema.Setting, node: Node) -> Any:
        """The converted value, or a :class:`_Refused` saying why there is none."""
        non_ascii = _non_ascii_digit(node)
        if non_ascii is not None:
            return _Refused(f"digits must be ASCII 0-9 (got {non_ascii!r})")
        digits = 0 if setting.kind in _TEXT_KINDS else _longest_number(node)
        if digits > MAX_NUMBER_DIGITS:
            return _Refused(f"number too large ({digits} digits; limit {MAX_NUMBER_DIGITS})")
        try:
            return self._convert(setting, node)
        except ValueError as exc:
            return _Refused(str(exc))
        except OverflowError:
            return _Refused(f"number too large (got {len(str(node.value))} characters)")
        except yaml.YAMLError as exc:
            return _Refused(f"unreadable value: {exc}")

    def _convert(self, setting: schema.Setting, node: Node) -> Any:
        raw = self._yaml.construct_object(node, deep=True)
        if raw is None and setting.nullable:
            return None
        if raw is None and setting.required:
            raise ValueError("must not be empty")
        if raw is None:
            raise ValueError(f"must not be empty (default: {show(setting.default)})")
        if setting.kind.text and isinstance(node, ScalarNode):
            value = setting.kind.convert(node.value)
        else:
            value = setting.kind.convert(raw)
        why = _violation(setting, value, raw)
        if why:
            raise ValueError(why)
        return value


Resolve = Callable[[Path], Path | None]


def _resolver(base: Path, data_dir: Path | None) -> Resolve:
    """Absolute normalised paths: ``{data_dir}/…`` against ``data_dir`` (None when unknown), others ``base``."""

    def resolve(path: Path) -> Path | None:
        head, _, rest = str(path).partition(os.sep)
        if head != schema.DATA_DIR_PREFIX:
            return Path(os.path.normpath(base / path))
        if data_dir is None:
            return None
        return Path(os.path.normpath(data_dir / rest))

    return resolve


def _command_line_path(path: Path) -> Path:
    """An override path from a command line: ``~`` expanded, absolute against the current folder, normalised."""
    return Path(os.path.normpath(os.path.abspath(Path(path).expanduser())))


def _command_line_setting(validator: _Validator, values: dict[str, Any], key: str, text: str) -> None:
    """Put ``text``, the value a command line gives the setting ``key`` (``http.port``), in place of the file's:
    converted and checked as the file's value would be (a text setting's value is taken as written; others read
    as a YAML scalar, so ``8080`` is a number); a refusal is reported under ``key``, without a line."""
    setting = schema.BY_KEY.get(key)
    if setting is None or "[]" in key:
        raise ValueError(f"{key!r} is not a setting a command line can give")
    section = values
    for name in key.split(".")[:-1]:
        section = section[name]
        if section is _BAD:  # that section is already refused
            return
    tag = "tag:yaml.org,2002:str"
    if setting.kind not in _TEXT_KINDS:
        tag = validator._yaml.resolve(ScalarNode, text, (True, False))
    validator.lines.pop(key, None)  # the file's line no longer says where the value comes from
    value = validator._refusal(setting, ScalarNode(tag, text))
    if isinstance(value, _Refused):
        message = secrets.hidden_value(value.message) if setting.secret else value.message
        validator.report(key, None, f"{message} (given on the command line)")
        value = _BAD
    section[setting.name] = value


def _build(cls: type, values: dict[str, Any], prefix: str, resolve: Resolve, **extra: Any) -> Any:
    """``cls(**values)``, sub-sections built recursively and paths resolved; ``extra`` fields as given."""
    kwargs = dict(extra)
    for declared in dataclasses.fields(cls):
        if declared.name in extra:
            continue
        key = prefix + declared.name
        value = values[declared.name]
        sub = schema.SECTION_BY_KEY.get(key)
        if sub is not None and sub.many:
            value = tuple(_build(CLASSES[key], item, sub.prefix, resolve) for item in value)
        elif sub is not None and value is not None:
            value = _build(CLASSES[key], value, sub.prefix, resolve)
        elif sub is None and schema.BY_KEY[key].kind.paths:
            value = tuple(resolve(path) for path in value) if isinstance(value, tuple) else resolve(value)
        kwargs[declared.name] = value
    return cls(**kwargs)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_models(validator: _Validator, models: Any, resolve: Resolve, exists: Callable[[Path], bool] | None) -> None:
    """Model names are unique; model files exist (``exists``: None skips it) unless generated when missing."""
    if not isinstance(models, list):
        return
    first: dict[str, int] = {}  # model name -> index of its first model
    for index, model in enumerate(models):
        if model is _BAD:
            continue
        name = model["name"]
        if name is not _BAD:
            if name in first:
                validator.report(f"models[{index}].name", validator.lines.get(f"models[{index}].name"),
                                 f"duplicate model name '{name}' (first at models[{first[name]}])")
            first.setdefault(name, index)
    _check_aliases(validator, models, first)
    for index, model in enumerate(models):
        if model is _BAD:
            continue
        if exists is None or model["path"] is _BAD or model["generate_if_missing"] is not None:
            continue
        path = resolve(model["path"])
        if path is not None and not exists(path):
            validator.report(f"models[{index}].path", validator.lines.get(f"models[{index}].path"),
                             f"no such file: {path} (or set generate_if_missing to create a demo model)")


def _check_aliases(validator: _Validator, models: list[Any], names: dict[str, int]) -> None:
    """No alias is a model's name or another model's alias (a name must find one model)."""
    owner: dict[str, int] = {}  # alias -> index of the model that lists it first
    for index, model in enumerate(models):
        if model is _BAD or model["aliases"] is _BAD:
            continue
        where = f"models[{index}].aliases"
        for alias in model["aliases"]:
            if alias in names:
                validator.report(where, validator.lines.get(where),
                                 f"alias '{alias}' is the name of models[{names[alias]}]")
            elif alias in owner and owner[alias] != index:
                validator.report(where, validator.lines.get(where),
                                 f"alias '{alias}' is already an alias of models[{owner[alias]}]")
            owner.setdefault(alias, index)


def _check_http(validator: _Validator, http: Any) -> None:
    """A non-loopback HTTP host needs an API token, and so does ``http.cors_origins: ["*"]``; scraping without the
    token on a non-loopback host needs ``http.confirm_public_scrape``."""
    if http is _BAD:
        return
    if http["cors_origins"] is not _BAD and schema.ANY_ORIGIN in http["cors_origins"] and http["api_token"] is None:
        validator.report("http.cors_origins", validator.lines.get("http.cors_origins"),
                         "'*' (any origin) requires http.api_token: without one, any web page a visitor opens "
                         "could use the API; list the origins instead")
    if http["host"] is _BAD:
        return
    if http["api_token"] is None and not _is_loopback(http["host"]):
        validator.report("http.host", validator.lines.get("http.host"),
                         f"binding to '{http['host']}' (not loopback) requires http.api_token")
    if http["scrape_without_token"] is True and http["confirm_public_scrape"] is not True \
            and not _is_loopback(http["host"]):
        validator.report("http.scrape_without_token", validator.lines.get("http.scrape_without_token"),
                         f"serving /metrics and /v1/health without http.api_token on '{http['host']}' (not "
                         "loopback) lets anyone who can reach the port read the model names, queue depth and "
                         "load: set http.confirm_public_scrape: true to allow it")


def _base_folder(source: Path | None, base_dir: Path | None) -> Path:
    """The absolute folder relative paths resolve against: ``base_dir``, else ``source``'s folder, else ".". """
    if base_dir is not None:
        folder = Path(base_dir)
    elif source is not None:
        folder = Path(source).parent
    else:
        folder = Path(".")
    return Path(os.path.abspath(folder.expanduser()))


class _TooBig(Exception):
    """The YAML breaks one of the shape limits (depth, aliases, expanded nodes) at ``line``."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def _event_line(event: Event) -> int:
    return event.start_mark.line + 1


def _check_shape(text: str) -> None:
    """Raise :class:`_TooBig` when ``text``'s YAML nests deeper than :data:`MAX_DEPTH`, uses more than
    :data:`MAX_ALIASES` aliases, or expands to more than :data:`MAX_NODES` nodes.

    It reads parser events only (no recursion, no values built), so it stops at the first event past a limit.
    The running total counts each alias as the size of the node it names, which is what constructing the
    values would build."""
    expanded = 0
    aliases = 0
    open_starts: list[tuple[str | None, int]] = []  # per open collection: its anchor, the total at its start
    sizes: dict[str, int] = {}  # anchor -> expanded size of its (complete) node
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, CollectionStartEvent):
            if len(open_starts) >= MAX_DEPTH:
                raise _TooBig(_event_line(event), f"nested deeper than {MAX_DEPTH} levels (limit {MAX_DEPTH})")
            open_starts.append((event.anchor, expanded))
            expanded += 1
        elif isinstance(event, CollectionEndEvent):
            anchor, start = open_starts.pop()
            if anchor is not None:
                sizes[anchor] = expanded - start
        elif isinstance(event, AliasEvent):
            aliases += 1
            if aliases > MAX_ALIASES:
                raise _TooBig(_event_line(event), f"more than {MAX_ALIASES} aliases (limit {MAX_ALIASES})")
            size = sizes.get(event.anchor)
            if size is None:
                raise _TooBig(_event_line(event), f"alias *{event.anchor} names no complete anchor before it")
            expanded += size
        elif isinstance(event, ScalarEvent):
            expanded += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        if isinstance(event, NodeEvent) and expanded > MAX_NODES:
            raise _TooBig(_event_line(event),
                          f"more than {MAX_NODES} values with aliases expanded (limit {MAX_NODES})")


def _too_large(file: str) -> Problem:
    return Problem("", None, f"the file is larger than {MAX_CONFIG_BYTES // 1024} KiB (limit {MAX_CONFIG_BYTES} bytes)",
                   file)


def _compose(text: str, file: str, source: Path | None) -> Node | None:
    """The YAML node tree of ``text``'s top-level mapping (None: empty), or :class:`ConfigInvalid`.

    The shape limits are checked on the parser's events first, so nothing recursive or expanding ever
    sees a hostile file."""
    size = len(text) if len(text) > MAX_CONFIG_BYTES else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigInvalid([_too_large(file)], source)
    try:
        _check_shape(text)
        root = yaml.compose(text, Loader=_LOADER)
    except _TooBig as exc:
        raise ConfigInvalid([Problem("", exc.line, f"YAML refused: {exc.message}", file)], source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
        detail = " ".join(str(part) for part in parts if part)
        line = None if mark is None else mark.line + 1
        problem = Problem("", line, f"YAML syntax error: {detail or exc}", file)
        raise ConfigInvalid([problem], source) from None
    if root is None or _is_null(root):
        return None
    if not isinstance(root, MappingNode):
        raise ConfigInvalid([Problem("", _line(root), "the top level must be a mapping of settings", file)], source)
    return root


def parse_config(
    text: str,
    *,
    source: Path | None = None,
    base_dir: Path | None = None,
    check_files: bool | Callable[[Path], bool] = False,
    data_dir: Path | None = None,
    socket_path: Path | None = None,
    settings: Mapping[str, str] | None = None,
) -> Config:
    """Validate ``text`` and return its :class:`Config`; raise :class:`ConfigInvalid` with all problems.

    Relative paths resolve against ``base_dir`` (default: ``source``'s folder, else the current folder).
    ``check_files``: True also refuses a model file that does not exist (``Path.is_file``; a callable replaces
    that check); a model with ``generate_if_missing`` is exempt. By default (False) a missing file is no problem:
    the appliance serves that model as ``missing`` until the file appears.

    ``data_dir`` and ``socket_path`` (``appliance run --data-dir/--socket``: systemd's state and runtime
    folders) replace the file's ``data_dir`` and ``socket.path``; ``{data_dir}/…`` paths follow the given
    ``data_dir``. They come from a command line, so a relative one resolves against the current folder.

    ``settings``: values of settings by key as a command line gives them (``appliance run --host/--port``:
    ``{"http.port": "8081"}``); each replaces the file's and is validated as the file's would be.
    """
    file = DEFAULT_FILE if source is None else str(source)
    base = _base_folder(source, base_dir)
    root = _compose(text, file, source)
    validator = _Validator(file)
    values = validator.mapping(root, "", "")
    if data_dir is not None:
        values["data_dir"] = _command_line_path(data_dir)
    if socket_path is not None and values["socket"] is not _BAD:
        values["socket"]["path"] = _command_line_path(socket_path)
    for key, text in (settings or {}).items():
        _command_line_setting(validator, values, key, text)

    state_dir = None
    if values["data_dir"] is not _BAD:
        state_dir = _resolver(base, None)(values["data_dir"])
        if state_dir is None:
            validator.report("data_dir", validator.lines.get("data_dir"),
                             f"cannot be relative to {schema.DATA_DIR_PREFIX} itself")
    resolve = _resolver(base, state_dir)

    if callable(check_files):
        exists = check_files
    elif check_files:
        exists = Path.is_file
    else:
        exists = None
    _check_models(validator, values["models"], resolve, exists)
    _check_http(validator, values["http"])

    if validator.problems:
        raise ConfigInvalid(validator.problems, source)
    return _build(Config, values, "", resolve, source=source, base_dir=base, lines=dict(validator.lines))


def load_config(
    path: str | os.PathLike[str],
    *,
    check_files: bool | Callable[[Path], bool] = False,
    data_dir: Path | None = None,
    socket_path: Path | None = None,
    settings: Mapping[str, str] | None = None,
) -> Config:
    """Read and parse the file at ``path``; an unreadable file raises :class:`ConfigInvalid` too.

    ``data_dir``, ``socket_path`` and ``settings`` override the file's, as in :func:`parse_config`."""
    source = Path(path)
    try:
        with source.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # never more: the file may be huge, or endless (a FIFO)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigInvalid([_too_large(str(source))], source)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigInvalid([Problem("", None, f"cannot read the file: {exc}", str(source))], source) from None
    return parse_config(text, source=source, check_files=check_files, data_dir=data_dir, socket_path=socket_path,
                        settings=settings)


def default_config(base_dir: str | os.PathLike[str]) -> Config:
    """Every setting at its default, no models; relative default paths resolve against ``base_dir``."""
    return parse_config("", base_dir=Path(base_dir), check_files=False)
