"""Every ``appliance.yaml`` knob (SPEC C1), declared once as data: :data:`SETTINGS` and :data:`SECTIONS`.

:mod:`appliance.config.validate` validates against them; :func:`render_docs` (``docs/configuration.md``, regenerate
with ``python -m appliance.config.schema > docs/configuration.md``) and :func:`render_help` print them. A
setting's ``key`` is its path in the file (``data_dir``, ``engine.warmup_runs``, ``models[].n_ctx``); its
``default`` is spelled as in YAML (``"16MiB"``) and converted like a file value. Pure: no IO.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

DATA_DIR_PREFIX = "{data_dir}"

_UNITS = {"": 1, "b": 1} | {u + s: (1024 if "i" in s else 1000) ** i
                             for i, u in enumerate("kmgt", 1) for s in ("", "b", "i", "ib")}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_MODE = re.compile(r"(?:0o|0)?([0-7]{3})")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def show(value: Any, quote: bool = True) -> str:
    """``value`` the way YAML would spell it, for messages (``quote``: strings in quotes) and docs."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(show(v, quote) for v in value) + "]"
    return repr(value) if isinstance(value, str) and quote else str(value)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string; raise ``ValueError`` otherwise.

    ``"8GiB"``, ``"512 MiB"``, ``"16Ki"``: binary (powers of 1024). ``"2G"``, ``"1.5GB"``, ``"100k"``:
    decimal (powers of 1000). Units are case-insensitive, ``B`` is optional, fractions round down.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"must not be negative (got {value})")
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"must be a number of bytes or a size like '16MiB', '2G' (got {show(value)})")
    return int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    """The shortest exact binary spelling of ``n`` bytes (``16MiB``), else the plain number."""
    for unit, mult in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def _typed(ok: Callable[[Any], bool], expected: str, cast: Callable[[Any], Any] = lambda v: v) -> Any:
    """A converter that accepts values passing ``ok`` (then ``cast``s them), else says ``expected``."""
    def convert(v: Any) -> Any:
        if not ok(v):
            raise ValueError(f"must be {expected} (got {show(v)})")
        return cast(v)
    return convert


def _isint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _isstr(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


_path = _typed(_isstr, "a path", lambda v: Path(v.strip()).expanduser())


def parse_device(v: Any) -> str:
    """A device spec, normalised: ``auto``, ``host``, ``nvml:N`` or ``fake:<size>``."""
    kind, colon, arg = (v.strip() if isinstance(v, str) else "").partition(":")
    kind, arg = kind.lower(), arg.strip()
    if kind in ("auto", "host") and not colon:
        return kind
    if kind == "nvml" and arg.isdigit():
        return f"nvml:{int(arg)}"
    match = _SIZE.fullmatch(arg)
    if kind == "fake" and match and match.group(2).lower() in _UNITS and parse_size(arg) > 0:
        return f"fake:{arg}"
    raise ValueError(f"must be auto, host, nvml:N or fake:<size> (got {show(v)})")


def parse_mode(v: Any) -> int:
    """A socket mode from its YAML text (``"0660"``, ``660``, ``0o660``): owner/group bits only (R4)."""
    match = _MODE.fullmatch(str(v).strip())
    if match is None:
        raise ValueError(f"must be an octal mode like \"0660\" (got {show(v)})")
    mode = int(match.group(1), 8)
    if mode & 0o007:
        raise ValueError(f"must not grant access to others: owner/group only (got {show(v)})")
    return mode


@dataclass(frozen=True)
class Kind:
    """A value type: its name in docs, and ``convert`` (YAML value -> Python value, ``ValueError``)."""

    name: str
    convert: Callable[[Any], Any]
    text: bool = False  # convert the scalar's source text, not the YAML-resolved value
    paths: bool = False  # result is Path(s) to resolve against the config folder


INT = Kind("integer", _typed(_isint, "an integer"))
FLOAT = Kind("number", _typed(lambda v: _isint(v) or isinstance(v, float), "a number", float))
BOOL = Kind("boolean", _typed(lambda v: isinstance(v, bool), "true or false"))
STR = Kind("string", _typed(_isstr, "a non-empty string (quote it if it looks like a number)", str.strip))
PATH = Kind("path", _path, paths=True)
PATHS = Kind("list of paths", _typed(lambda v: isinstance(v, list), "a list of folders",
                                     lambda v: tuple(map(_path, v))), paths=True)
SIZE = Kind("size", parse_size)
VRAM = Kind("`auto` or size", lambda v: None if v == "auto" else parse_size(v))
DEVICE = Kind("device", parse_device)
MODE = Kind("octal mode", parse_mode, text=True)
PAIR = Kind("two integers", _typed(lambda v: isinstance(v, list) and len(v) == 2 and all(map(_isint, v)),
                                   "a list of two integers", tuple))
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


@dataclass(frozen=True)
class Setting:
    """One knob. ``live``: a change applies to a running daemon (model keys: without reloading it)."""

    key: str
    kind: Kind
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    nullable: bool = False
    live: bool = True
    check: Callable[[Any], str | None] | None = None

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]

    @property
    def section(self) -> str:
        """The key of the enclosing :class:`Section` (``""`` for the top level)."""
        return self.key.rpartition(".")[0].removesuffix("[]")

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def describe(self) -> str:
        """The help text plus its bounds / choices, in one sentence-ish string."""
        lo, hi = ("" if b is None else (format_size if self.kind is SIZE else show)(b)
                  for b in (self.minimum, self.maximum))
        bounds = f"range {lo}..{hi}" if lo and hi else f"≥ {lo}" if lo else f"≤ {hi}" if hi else ""
        extra = [f"one of: {', '.join(self.choices)}"] * bool(self.choices) + [bounds] * bool(bounds) + [
            "may be null"] * self.nullable
        return self.help + (f" ({'; '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class Section:
    """A nested mapping (``socket``), a list of mappings (``many``: ``models``), or an ``optional``
    mapping that may be absent or null (``models[].generate_if_missing``)."""

    key: str
    help: str
    many: bool = False
    optional: bool = False

    @property
    def prefix(self) -> str:
        """What this section's settings' keys start with: ``socket.``, ``models[].``."""
        return self.key + ("[]." if self.many else ".")


_LEVELS = ("debug", "info", "warning", "error", "critical")
_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
_GEN = "models[].generate_if_missing"

SECTIONS: tuple[Section, ...] = (
    Section("socket", "The Unix socket (MAGN frames and the line protocol)."),
    Section("http", "The HTTP server: OpenAI API, health, metrics, admin page."),
    Section("engine", "The adaptive engine (SPEC E)."),
    Section("models", "The configured models; each is served under its name.", many=True),
    Section(_GEN, "Write a tiny random-weight model to `path` when the file is missing (demo and tests; "
            "done by `appliance run`).", optional=True),
)

SETTINGS: tuple[Setting, ...] = (
    Setting("data_dir", PATH, "./data", "State folder: registry file, results, generated demo models. Relative "
            f"paths resolve against the config file's folder; `{DATA_DIR_PREFIX}/…` against this.", live=False),
    Setting("device", DEVICE, "auto", "Memory device: `auto`, `host`, `nvml:N`, or `fake:<size>` for tests "
            "(`fake:8GiB`).", live=False),
    Setting("admission_percent", FLOAT, 90, "Ledger cap as a percentage of the device's total memory.", 1, 100),
    Setting("resync_interval_s", FLOAT, 30, "Seconds between periodic device re-reads; 0 = off.", 0, 86400),
    Setting("model_dirs", PATHS, [f"{DATA_DIR_PREFIX}/models"], "Folders a REGISTER may name a GGUF path in; "
            "configured models may live anywhere."),
    Setting("max_connections", INT, 128, "Concurrent client connections, all surfaces together.", 1, 65536),
    Setting("max_frame_bytes", SIZE, "16MiB", "Largest MAGN frame payload; longer ones are refused unread.",
            1024, 1024**3),
    Setting("heartbeat_interval_s", FLOAT, 2.0, "HEARTBEAT after this many seconds without a token.", 0.1, 3600),
    Setting("log_level", STR, "info", "Log verbosity.", choices=_LEVELS),
    Setting("socket.path", PATH, f"{DATA_DIR_PREFIX}/appliance.sock", "Socket file path.", live=False),
    Setting("socket.mode", MODE, "0660", "Socket permissions (quote it); no bits for others.", live=False),
    Setting("socket.group", STR, None, "Group to own the socket; null = the daemon's group.", nullable=True,
            live=False),
    Setting("http.host", STR, "127.0.0.1", "Address to bind; a non-loopback one needs http.api_token.", live=False),
    Setting("http.port", INT, 8080, "TCP port; 0 = any free port.", 0, 65535, live=False),
    Setting("http.api_token", STR, None, "Bearer token HTTP requests must carry; null = none (loopback only).",
            nullable=True),
    Setting("engine.adaptive_window_size", INT, 64, "Requests in the profiler's sliding window.", 1, 100000),
    Setting("engine.adaptive_sample_rate", INT, 4, "Profile every N-th request.", 1, 10000),
    Setting("engine.hot_pool_slack", FLOAT, 1.2, "Hot KV pool size as a multiple of the observed peak.", 1.0, 10.0),
    Setting("engine.async_switch", BOOL, True, "Switch plans off the request path."),
    Setting("engine.thread_idle_thresholds", PAIR, [60, 30], "CPU idle % bands: above the first -> 4 threads, "
            "between -> 3, below the second -> 2.",
            check=lambda v: None if 0 <= v[1] < v[0] <= 100 else "must be two percentages, first above second"),
    Setting("engine.warmup_runs", INT, 8, "Requests profiled before the first plan change.", 0, 100000),
    Setting("engine.plan_boundaries", PAIR, [128, 512], "P90 input tokens separating plans S/M/L.",
            check=lambda v: None if 1 <= v[0] < v[1] else "must be two token counts, first below second"),
    Setting("engine.threads", INT, 0, "Fixed thread count; 0 = choose automatically.", 0, 1024),
    Setting("models[].name", STR, REQUIRED, "Model name used by clients.", check=lambda v: None
            if MODEL_NAME.fullmatch(v) else "must be 1-64 of letters, digits, '_', '.', ':', '-'"),
    Setting("models[].path", PATH, REQUIRED, "GGUF file; must exist unless generate_if_missing is set.", live=False),
    Setting("models[].vram_bytes", VRAM, "auto", "Ledger estimate: `auto` (from GGUF metadata) or the operator's "
            "figure.", live=False),
    Setting("models[].n_ctx", INT, 2048, "Context size in tokens.", 16, 1 << 20, live=False),
    Setting("models[].n_gpu_layers", INT, 0, "Layers offloaded to the GPU; -1 = all.", -1, 100000, live=False),
    Setting("models[].idle_ttl_s", FLOAT, 1800, "Unload after this many idle seconds; 0 = never.", 0),
    Setting("models[].cache_type", STR, "f16", "KV cache element type.", choices=_CACHE_TYPES, live=False),
    Setting(f"{_GEN}.layers", INT, REQUIRED, "Transformer layers.", 1, 64),
    Setting(f"{_GEN}.dim", INT, REQUIRED, "Embedding width (dim // 64 heads).", 32, 4096, check=lambda v: None
            if v % 64 == 0 or (v < 128 and v % 2 == 0) else "must be a multiple of 64 (or even and below 128)"),
    Setting(f"{_GEN}.seed", INT, 0, "Random seed.", 0, 2**32 - 1),
)

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
SECTION_BY_KEY: dict[str, Section] = {s.key: s for s in SECTIONS}


def members(section: str) -> tuple[dict[str, Setting], dict[str, Section]]:
    """The settings and sub-sections directly inside ``section`` (``""`` = top level), by name."""
    settings = {s.name: s for s in SETTINGS if s.section == section}
    subs = {s.key.rpartition(".")[2]: s for s in SECTIONS
            if s.key.rpartition(".")[0].removesuffix("[]") == section}
    return settings, subs


def render_help() -> str:
    """Plain text, one setting per line, for ``--help`` and ``appliance config check``."""
    width = max(len(s.key) for s in SETTINGS)
    return "\n".join(f"  {s.key:<{width}}  {s.describe()} "
                     f"[{'required' if s.required else 'default: ' + show(s.default, False)}]" for s in SETTINGS)


def render_docs() -> str:
    """Markdown reference of every setting (key path, type, default, live, help); the whole of
    ``docs/configuration.md``."""
    out = ["# Configuration reference", "", "<!-- Generated by appliance.config.schema.render_docs(); do not edit: "
           "python -m appliance.config.schema > docs/configuration.md -->", "",
           "The appliance reads one YAML file, `appliance.yaml`. Every key may be omitted and takes its default, "
           "except those marked *required*. Unknown keys, wrong types and out-of-range values are errors, "
           "reported all at once with their line (`appliance config check FILE`).", "",
           "- **size**: bytes, or a string like `8GiB`, `512 MiB` (binary: Ki, Mi, Gi, Ti = powers of 1024) or "
           "`2G`, `1.5GB` (decimal: K, M, G, T = powers of 1000); case-insensitive, fractions round down.",
           "- **path**: `~` expands; relative paths resolve against the config file's folder; one starting "
           f"with `{DATA_DIR_PREFIX}/` (quote it in YAML) against `data_dir`.",
           "- **device**: `auto` (NVML GPU 0 if present, else host), `host` (RAM), `nvml:N`, or `fake:<size>` "
           "(a simulated device of that size, for tests).",
           "- **octal mode**: write it quoted, `\"0660\"`; bits for others are refused.",
           "- **live**: *yes* = a reload applies a change without a restart (model keys: without reloading "
           "the weights).", ""]
    groups = [("", "Top level", "")] + [(s.key, f"`{s.key}`", s.help + (" A list." if s.many else "")
                                         + (" Optional." if s.optional else "")) for s in SECTIONS]
    for key, title, text in groups:
        out += [f"## {title}", ""] + ([text, ""] if text else [])
        out += ["| Key | Type | Default | Live | Description |", "|---|---|---|---|---|"]
        for s in SETTINGS:
            if s.section == key:
                default = "*required*" if s.required else f"`{show(s.default, quote=False)}`"
                row = [f"`{s.key}`", s.kind.name, default, "yes" if s.live else "no", s.describe()]
                out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render_docs(), end="")
