"""Every ``appliance.yaml`` knob (SPEC C1), declared once as data: :data:`SETTINGS` and :data:`SECTIONS`.

:mod:`appliance.config.validate` validates against them; :func:`render_docs` (``docs/configuration.md``, regenerate
with ``python -m appliance.config.schema > docs/configuration.md``) and :func:`render_help` print them.

- A setting's ``key`` is its path in the file (``data_dir``, ``engine.warmup_runs``, ``models[].n_ctx``).
- Its ``default`` is spelled as in YAML (``"16MiB"``) and converted like a file value.

Pure: no IO.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

DATA_DIR_PREFIX = "{data_dir}"
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
INSTANCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}", re.ASCII)
"""``http.instance_name``: a header value a router can key on (``box-1``, ``edge-7.lan:8080``)."""
MODEL_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}")
"""An alias may also hold ``/``, ``@`` and ``+`` (agent CLIs send names like ``openai/gpt-4.1``)."""
HOST_NAME = re.compile(r"(?:[A-Za-z0-9_*](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])", re.ASCII)
"""A name ``http.allowed_hosts`` may hold: a DNS name (``*.`` for its subdomains), an IPv4 or a bracketed IPv6."""

# Size units, lower-cased: K, M, G, T are powers of 1000; Ki, Mi, Gi, Ti powers of 1024; a trailing B is optional.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "ki": 1024,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mi": 1024**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gi": 1024**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ti": 1024**4,
    "tib": 1024**4,
}
# The binary units format_size spells a size with, largest first.
_BINARY_UNITS: list[tuple[str, int]] = [
    ("TiB", 1024**4),
    ("GiB", 1024**3),
    ("MiB", 1024**2),
    ("KiB", 1024),
]
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)
_MODE = re.compile(r"(?:0o|0)?([0-7]{3})")


def show(value: Any, quote: bool = True) -> str:
    """``value`` the way YAML would spell it, for messages (``quote``: strings in quotes) and docs."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        items = [show(item, quote) for item in value]
        return "[" + ", ".join(items) + "]"
    if isinstance(value, str) and quote:
        return repr(value)
    return str(value)


def _size_match(text: str) -> re.Match[str] | None:
    """The match of a size string (number, then a known unit), or None."""
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2).lower() not in _UNITS:
        return None
    return match


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string; raise ``ValueError`` otherwise.

    ``"8GiB"``, ``"512 MiB"``, ``"16Ki"``: binary (powers of 1024). ``"2G"``, ``"1.5GB"``, ``"100k"``:
    decimal (powers of 1000). Units are case-insensitive, ``B`` is optional, fractions round down.
    """
    if _is_int(value):
        if value < 0:
            raise ValueError(f"must not be negative (got {value})")
        return value
    match = _size_match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"must be a number of bytes or a size like '16MiB', '2G' (got {show(value)})")
    number, unit = match.groups()
    return int(Fraction(number) * _UNITS[unit.lower()])


def format_size(n: int) -> str:
    """The shortest exact binary spelling of ``n`` bytes (``16MiB``), else the plain number."""
    if n == 0:
        return str(n)
    for unit, multiple in _BINARY_UNITS:
        if n % multiple == 0:
            return f"{n // multiple}{unit}"
    return str(n)


def parse_device(value: Any) -> str:
    """A device spec, normalised: ``auto``, ``host``, ``nvml:N`` or ``fake:<size>``."""
    text = value.strip() if isinstance(value, str) else ""
    kind, colon, argument = text.partition(":")
    kind = kind.lower()
    argument = argument.strip()
    if kind in ("auto", "host") and not colon:
        return kind
    if kind == "nvml" and argument.isascii() and argument.isdigit() and len(argument) <= 3:
        return f"nvml:{int(argument)}"
    if kind == "fake" and _size_match(argument) is not None and parse_size(argument) > 0:
        return f"fake:{argument}"
    raise ValueError(f"must be auto, host, nvml:N or fake:<size> (got {show(value)})")


def parse_mode(value: Any) -> int:
    """A socket mode from its YAML text (``"0660"``, ``660``, ``0o660``): owner/group bits only (R4)."""
    match = _MODE.fullmatch(str(value).strip())
    if match is None:
        raise ValueError(f'must be an octal mode like "0660" (got {show(value)})')
    mode = int(match.group(1), 8)
    if mode & 0o007:
        raise ValueError(f"must not grant access to others: owner/group only (got {show(value)})")
    return mode


ORIGIN_PORTS = {"http": 80, "https": 443}
"""The schemes an origin may have, and the port each implies (omitted from an origin's canonical spelling)."""
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://([a-z0-9_](?:[a-z0-9_.-]{0,252})|\[[0-9a-f:.]{2,45}\])(?::([0-9]{1,5}))?",
                     re.ASCII)
ANY_ORIGIN = "*"


def parse_origin(value: Any) -> str:
    """A web origin (``scheme://host[:port]``, as a browser's ``Origin`` header spells it) in its canonical
    spelling: lower-cased, the scheme's default port left out; ``ValueError`` for anything else (a path, a
    trailing slash, a scheme other than http and https, a port over 65535)."""
    text = value.strip().lower() if isinstance(value, str) else ""
    match = _ORIGIN.fullmatch(text)
    problem = f"must be an origin like 'https://app.example.com' or 'http://localhost:3000': http or https, a host, " \
              f"an optional port, no path (got {show(value)})"
    if match is None:
        raise ValueError(problem)
    scheme, host, port = match.groups()
    if scheme not in ORIGIN_PORTS or (port is not None and int(port) > 65535) or ".." in host:
        raise ValueError(problem)
    if port is None or int(port) == ORIGIN_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{int(port)}"


# --- value kinds: YAML value -> Python value, or ValueError ----------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text(value: Any) -> bool:
    """A string with something besides whitespace."""
    return isinstance(value, str) and bool(value.strip())


def _to_int(value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"must be an integer (got {show(value)})")
    return value


def _to_float(value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"must be a number (got {show(value)})")
    return float(value)


def _to_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false (got {show(value)})")
    return value


def _to_str(value: Any) -> str:
    if not _is_text(value):
        raise ValueError(f"must be a non-empty string (quote it if it looks like a number) (got {show(value)})")
    return value.strip()


def _to_path(value: Any) -> Path:
    if not _is_text(value):
        raise ValueError(f"must be a path (got {show(value)})")
    return Path(value.strip()).expanduser()


def _to_paths(value: Any) -> tuple[Path, ...]:
    if not isinstance(value, list):
        raise ValueError(f"must be a list of folders (got {show(value)})")
    paths = []
    for item in value:
        paths.append(_to_path(item))
    return tuple(paths)


def _to_hosts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"must be a list of host names (got {show(value)})")
    hosts = []
    for item in value:
        if not isinstance(item, str) or not HOST_NAME.fullmatch(item.strip()):
            raise ValueError(f"each item must be a host name or address, without port or scheme (got {show(item)})")
        hosts.append(item.strip().lower())
    return tuple(hosts)


def _to_origins(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"must be a list of origins (got {show(value)})")
    origins: list[str] = []
    for item in value:
        origin = ANY_ORIGIN if isinstance(item, str) and item.strip() == ANY_ORIGIN else parse_origin(item)
        if origin in origins:
            raise ValueError(f"origin {origin!r} is listed twice")
        origins.append(origin)
    return tuple(origins)


def _to_aliases(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"must be a list of names (got {show(value)})")
    aliases: list[str] = []
    for item in value:
        if not isinstance(item, str) or not MODEL_ALIAS.fullmatch(item):
            raise ValueError("each alias must be 1-128 of letters, digits, '_', '.', ':', '/', '@', '+', '-', starting "
                             f"with a letter or digit (got {show(item)})")
        if item in aliases:
            raise ValueError(f"alias {item!r} is listed twice")
        aliases.append(item)
    return tuple(aliases)


def _to_vram(value: Any) -> int | None:
    """``auto`` (None: estimate from the GGUF metadata) or a size."""
    if value == "auto":
        return None
    return parse_size(value)


def _to_auto_count(value: Any) -> int | None:
    """``auto`` (None: as many as fit) or a count of at least 1."""
    if value == "auto":
        return None
    count = _to_int(value)
    if count < 1:
        raise ValueError(f"must be `auto` or at least 1 (got {show(value)})")
    return count


def _to_gpu_layers(value: Any) -> int | None:
    """``auto`` (None: as many layers as the ledger admits) or a count (-1 = all)."""
    if value == "auto":
        return None
    if not _is_int(value):
        raise ValueError(f"must be `auto` or an integer (got {show(value)})")
    return value


def _to_flash(value: Any) -> str:
    """``auto``, or a boolean: ``on`` / ``off``."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    raise ValueError(f"must be `auto`, true or false (got {show(value)})")


def _to_pair(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and _is_int(value[0]) and _is_int(value[1])):
        raise ValueError(f"must be a list of two integers (got {show(value)})")
    return (value[0], value[1])


@dataclass(frozen=True)
class Kind:
    """A value type: its name in docs, and ``convert`` (YAML value -> Python value, ``ValueError``)."""

    name: str
    convert: Callable[[Any], Any]
    text: bool = False  # convert the scalar's source text, not the YAML-resolved value
    paths: bool = False  # result is Path(s) to resolve against the config folder


INT = Kind("integer", _to_int)
FLOAT = Kind("number", _to_float)
BOOL = Kind("boolean", _to_bool)
STR = Kind("string", _to_str)
PATH = Kind("path", _to_path, paths=True)
PATHS = Kind("list of paths", _to_paths, paths=True)
SIZE = Kind("size", parse_size)
VRAM = Kind("`auto` or size", _to_vram)
DEVICE = Kind("device", parse_device)
MODE = Kind("octal mode", parse_mode, text=True)
PAIR = Kind("two integers", _to_pair)
HOSTS = Kind("list of host names", _to_hosts)
ORIGINS = Kind("list of origins", _to_origins)
ALIASES = Kind("list of names", _to_aliases)
AUTO_COUNT = Kind("`auto` or integer", _to_auto_count)
GPU_LAYERS = Kind("`auto` or integer", _to_gpu_layers)
FLASH = Kind("`auto` or boolean", _to_flash)


class _Required:
    """The default of a setting that has none: the file must give it."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


# --- settings and sections -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One knob. ``live``: a change applies to a running daemon (model keys: without reloading it).

    ``check`` is a rule beyond kind, range and choices: it returns why a converted value is refused, or None.
    """

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
    secret: bool = False  # never shown: not in messages, logs, dumps or pages (:mod:`appliance.config.secrets`)

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

    def spell(self, value: Any) -> str:
        """A value or bound of this setting in messages and docs: sizes in binary units (``1KiB``)."""
        if self.kind is SIZE:
            return format_size(value)
        return show(value)

    def describe(self) -> str:
        """The help text plus its bounds / choices, in one sentence-ish string."""
        notes = []
        if self.choices:
            notes.append(f"one of: {', '.join(self.choices)}")
        if self.minimum is not None and self.maximum is not None:
            notes.append(f"range {self.spell(self.minimum)}..{self.spell(self.maximum)}")
        elif self.minimum is not None:
            notes.append(f"≥ {self.spell(self.minimum)}")
        elif self.maximum is not None:
            notes.append(f"≤ {self.spell(self.maximum)}")
        if self.nullable:
            notes.append("may be null")
        if not notes:
            return self.help
        return f"{self.help} ({'; '.join(notes)})"


@dataclass(frozen=True)
class Section:
    """A nested mapping (``socket``), a list of mappings (``many``: ``models``), or an ``optional``
    mapping that may be absent or null (``models[].generate_if_missing``)."""

    key: str
    help: str
    many: bool = False
    optional: bool = False

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]

    @property
    def section(self) -> str:
        """The key of the enclosing section (``""`` for the top level)."""
        return self.key.rpartition(".")[0].removesuffix("[]")

    @property
    def prefix(self) -> str:
        """What this section's settings' keys start with: ``socket.``, ``models[].``."""
        if self.many:
            return self.key + "[]."
        return self.key + "."


def _check_thresholds(value: tuple[int, int]) -> str | None:
    high, low = value
    if 0 <= low < high <= 100:
        return None
    return "must be two percentages, first above second"


def _check_plan_boundaries(value: tuple[int, int]) -> str | None:
    small, large = value
    if 1 <= small < large:
        return None
    return "must be two token counts, first below second"


def _check_model_name(value: str) -> str | None:
    if MODEL_NAME.fullmatch(value):
        return None
    return "must be 1-64 of letters, digits, '_', '.', ':', '-'"


def _check_instance_name(value: str) -> str | None:
    if INSTANCE_NAME.fullmatch(value):
        return None
    return "must be 1-64 of letters, digits, '_', '.', ':', '-' (null: the host name and HTTP port)"


def _check_tiny_dim(value: int) -> str | None:
    if value % 64 == 0:
        return None
    if value < 128 and value % 2 == 0:
        return None
    return "must be a multiple of 64 (or even and below 128)"


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")
_GEN = "models[].generate_if_missing"

SECTIONS: tuple[Section, ...] = (
    Section("socket", "The Unix socket (MAGN frames and the line protocol)."),
    Section("http", "The HTTP server: OpenAI API, health, metrics, admin page."),
    Section("engine", "The adaptive engine."),
    Section("models", "The configured models; each is served under its name.", many=True),
    Section(
        _GEN,
        "Write a tiny random-weight model to `path` when the file is missing (demo and tests; "
        "done by `appliance run`).",
        optional=True,
    ),
)

SETTINGS: tuple[Setting, ...] = (
    # top level
    Setting(
        "data_dir", PATH, "./data",
        "State folder: registry file, results, generated demo models. Relative paths resolve against the config "
        f"file's folder; `{DATA_DIR_PREFIX}/…` against this.",
        live=False,
    ),
    Setting(
        "device", DEVICE, "auto",
        "Memory device: `auto`, `host`, `nvml:N`, or `fake:<size>` for tests (`fake:8GiB`).",
        live=False,
    ),
    Setting(
        "admission_percent", FLOAT, 90,
        "Ledger cap as a percentage of the device's total memory.",
        minimum=1, maximum=100,
    ),
    Setting(
        "resync_interval_s", FLOAT, 30,
        "Seconds between periodic device re-reads; 0 = off.",
        minimum=0, maximum=86400,
    ),
    Setting(
        "model_dirs", PATHS, [f"{DATA_DIR_PREFIX}/models"],
        "Folders a REGISTER may name a GGUF path in; configured models may live anywhere.",
    ),
    Setting(
        "max_connections", INT, 128,
        "Concurrent client connections, all surfaces together.",
        minimum=1, maximum=65536,
    ),
    Setting(
        "max_frame_bytes", SIZE, "16MiB",
        "Largest MAGN frame payload; longer ones are refused unread.",
        minimum=1024, maximum=1024**3,
    ),
    Setting(
        "heartbeat_interval_s", FLOAT, 2.0,
        "HEARTBEAT after this many seconds without a token.",
        minimum=0.1, maximum=3600,
    ),
    Setting("log_level", STR, "info", "Log verbosity.", choices=_LOG_LEVELS),
    Setting(
        "max_tasks_per_connection", INT, 4,
        "Tasks in flight on one connection; more are refused with TOO_MANY_TASKS.",
        minimum=1, maximum=1024,
    ),
    Setting(
        "host_kv_budget", VRAM, "auto",
        "Host RAM for parked agents' KV state; `auto` = a quarter of physical RAM.",
    ),
    Setting(
        "disk_kv_budget", VRAM, "auto",
        "Disk for parked agents' KV state under data_dir/kv/ (past host_kv_budget, and at a graceful stop); "
        "`auto` = a quarter of the free space at start; 0 = off.",
        live=False,
    ),
    Setting(
        "agent_idle_ttl_s", FLOAT, 86400,
        "Unregister an agent that has not decoded for this long (default: a day); 0 = never.",
        minimum=0, maximum=31536000,
    ),
    Setting(
        "max_agents", INT, 1024,
        "Registered agents, all surfaces together; one more is refused with TOO_MANY_AGENTS.",
        minimum=1, maximum=1000000,
    ),
    Setting(
        "shutdown_grace_s", FLOAT, 10,
        "On SIGTERM, running requests get this long to finish before they end with SHUTTING_DOWN.",
        minimum=0, maximum=3600,
    ),
    # socket
    Setting("socket.path", PATH, f"{DATA_DIR_PREFIX}/appliance.sock", "Socket file path; a reload rebinds it."),
    Setting("socket.mode", MODE, "0660", "Socket permissions (quote it); no bits for others."),
    Setting(
        "socket.group", STR, None,
        "Group to own the socket; null = the daemon's group.",
        nullable=True,
    ),
    Setting(
        "socket.request_timeout_s", FLOAT, 10,
        "A request line or frame once started must arrive whole within this many seconds.",
        minimum=0.1, maximum=3600,
    ),
    Setting(
        "socket.idle_timeout_s", FLOAT, 300,
        "Close a connection with no task running and no bytes received for this long; 0 = never.",
        minimum=0, maximum=86400,
    ),
    Setting(
        "socket.stall_timeout_s", FLOAT, 10,
        "A stream whose client stops reading pauses; after this many seconds it is cancelled.",
        minimum=0.1, maximum=3600,
    ),
    # http
    Setting(
        "http.host", STR, "127.0.0.1",
        "Address to bind; a non-loopback one needs http.api_token. A reload rebinds it.",
    ),
    Setting("http.port", INT, 8080, "TCP port; 0 = any free port. A reload rebinds it.", minimum=0, maximum=65535),
    Setting(
        "http.api_token", STR, None,
        "Bearer token HTTP requests must carry; null = none (loopback only). Secret: never shown or logged.",
        nullable=True, secret=True,
    ),
    Setting(
        "http.allowed_hosts", HOSTS, [],
        "Host names HTTP requests may address besides loopback names and addresses, http.host and the address a "
        "request arrived on (a `Host` header naming anything else is refused: DNS rebinding); `*.example.com` "
        "allows its subdomains, `*` any name (turns the check off: only behind a proxy that checks it).",
    ),
    Setting(
        "http.cors_origins", ORIGINS, [],
        "Web origins (`scheme://host[:port]`) whose pages may call the API (`/v1/…`, `/health`) from a browser: "
        "their requests get CORS headers and pass the cross-origin check (never on /admin/); each still needs "
        "http.api_token when one is set, sent as a header (the admin session cookie does not count). `*`: any "
        "origin, only with http.api_token (without one, any page a visitor opens could use the API). Empty: "
        "cross-origin browser requests are refused.",
    ),
    Setting(
        "http.keep_alive_timeout_s", FLOAT, 5,
        "Close an idle keep-alive HTTP connection after this many seconds.",
        minimum=0.1, maximum=3600,
    ),
    Setting(
        "http.scrape_without_token", BOOL, False,
        "Serve /metrics and the health document (/v1/health, /health) without http.api_token, for scrapers and "
        "routers that cannot send one; every other route still requires it. With a non-loopback http.host it "
        "also needs http.confirm_public_scrape: anyone who reaches the port then reads the model names, queue "
        "depth and load.",
    ),
    Setting(
        "http.confirm_public_scrape", BOOL, False,
        "Confirms http.scrape_without_token on a non-loopback http.host (no effect on its own).",
    ),
    Setting(
        "http.instance_name", STR, None,
        "This appliance's name in a fleet: sent as the `x-appliance-instance` header of generation replies, "
        "/v1/health and /v1/models (a router keeps an agent on its box by it), and shown by /v1/health and "
        "STATUS. null = `<host name>:<http port>`.",
        nullable=True, check=_check_instance_name,
    ),
    # engine
    Setting(
        "engine.adaptive_window_size", INT, 64,
        "Requests in the profiler's sliding window.",
        minimum=1, maximum=100000,
    ),
    Setting(
        "engine.adaptive_sample_rate", INT, 4,
        "Profile one request in N, picked at random (seeded), so that agents answering in waves of N do not keep "
        "only one place of every wave.",
        minimum=1, maximum=10000,
    ),
    Setting(
        "engine.hot_pool_slack", FLOAT, 1.2,
        "Adaptive engine: the hot KV pool is the profiled requests' P90 KV need times this (in steps of 256 cells, "
        "at most the model's n_ctx); the need counts the requests waiting for cells, and the pool grows at once when "
        "they wait, or when one request is longer than it (it shrinks only past a 25% margin).",
        minimum=1.0, maximum=10.0,
    ),
    Setting(
        "engine.async_switch", BOOL, True,
        "Adaptive engine: build the next pool/plan's context in its own engine job beside the live one and swap it "
        "in between requests; false = rebuild it inline at the model's next request (which waits for it).",
    ),
    Setting(
        "engine.thread_idle_thresholds", PAIR, [60, 30],
        "CPU idle % bands: above the first -> 4 threads, between -> 3, below the second -> 2.",
        check=_check_thresholds,
    ),
    Setting(
        "engine.warmup_runs", INT, 8,
        "Warm-up inferences that seed each model's load profile when it loads (off the request path; health says "
        "`warming` meanwhile). 0 = none.",
        minimum=0, maximum=100000,
    ),
    Setting(
        "engine.plan_boundaries", PAIR, [128, 512],
        "P90 input tokens separating plans S/M/L.",
        check=_check_plan_boundaries,
    ),
    Setting(
        "engine.threads", INT, 0,
        "Thread count of every context: N pins it; 0 = chosen by the adaptive engine from the CPU the process can "
        "get (at most 4), or min(4, cores) with `engine.adaptive: false`. A reload applies it. Never more than the "
        "cores the process may use (a larger N is cut to them, with a warning; TUNE refuses it).",
        minimum=0, maximum=1024,
    ),
    Setting(
        "engine.live_slots", INT, 4,
        "Conversations of one model decoded together in its live context (one sequence each, one llama_decode "
        "per step); more agents park in host RAM. 1 = one at a time. A change applies to models loaded after it.",
        minimum=1, maximum=64,
    ),
    Setting(
        "engine.flash_attention", FLASH, "auto",
        "llama.cpp's flash attention in live contexts. `auto`: on wherever llama.cpp can run it for the model on "
        "its device (always on the CPU); true: on; false: off. STATUS, /v1/health and the admin page show what "
        "each live context runs. On is faster (12-layer 768-wide model, 8 sequences, 2 CPU threads, side by side on "
        "a loaded box): batched decoding 1.5x the tokens/s, and parking a conversation 58x faster, its V cache not "
        "being transposed (one 128-cell sequence beside 7 others: 1.1 ms against 65 ms). false is for an "
        "operator who needs a request's text byte-equal whether it was decoded beside others or alone: with flash "
        "attention a sequence decoded beside others rounds differently (its logits differ by about 1e-3; a "
        "near-tie greedy token may differ). A quantized `cache_type` needs it (false refuses one). A change applies "
        "to models loaded after it (a loaded model keeps saving its parked conversations in its own V layout); a "
        "conversation saved in host RAM or on disk under the other V layout is re-evaluated from its tokens.",
    ),
    Setting(
        "engine.adaptive", BOOL, True,
        "true: each model's live context follows its load profile (hot pool size, split KV streams where requests "
        "run together, plan S/M/L, threads from the CPU the process can get). false: the fixed strategy (the "
        "model's n_ctx preallocated, one plan, `engine.threads` or the default count). A reload switches live.",
    ),
    Setting(
        "engine.live_contexts", AUTO_COUNT, "auto",
        "Live contexts on the device at once: `auto` = as many as the ledger fits (the least recently used idle one "
        "is freed when a new one would not fit); N = at most N (1 = one live context on the device: decoding "
        "on another model parks this one's agents and frees its context).",
    ),
    # models[]
    Setting("models[].name", STR, REQUIRED, "Model name used by clients.", check=_check_model_name),
    Setting(
        "models[].aliases", ALIASES, [],
        "Other names clients may ask for this model by, on every surface (agent CLIs send fixed names such as "
        "`gpt-4.1`); listed by /v1/models. No alias may be another model's name or alias.",
    ),
    Setting(
        "models[].path", PATH, REQUIRED,
        "GGUF file. One that is not there does not make the config invalid: the other models serve, this one is "
        "`missing` (health `degraded` naming this line, its requests refused with `MODEL_MISSING`) until the file "
        "is there, without a reload; generate_if_missing writes a demo model there at start instead.",
        live=False,
    ),
    Setting(
        "models[].vram_bytes", VRAM, "auto",
        "Ledger estimate: `auto` (from GGUF metadata) or the operator's figure.",
        live=False,
    ),
    Setting(
        "models[].n_ctx", INT, 2048,
        "Context size in tokens.",
        minimum=16, maximum=1 << 20, live=False,
    ),
    Setting(
        "models[].n_gpu_layers", GPU_LAYERS, 0,
        "Layers offloaded to the GPU (llama.cpp counts the blocks and the output layer): 0 = none, -1 = all, `auto` "
        "= as many as the ledger's free bytes hold when the model loads. Only the offloaded layers' weights and KV "
        "cache count against the GPU's ledger; the rest is in host RAM. Where no layer can be offloaded (the device "
        "is `host`, or the tests' `fake:`, or llama.cpp was built without GPU support) the model runs on the CPU, "
        "with a warning when a number other than 0 was asked for; `auto` then means the CPU.",
        minimum=-1, maximum=100000, live=False,
    ),
    Setting(
        "models[].idle_ttl_s", FLOAT, 1800,
        "Unload after this many idle seconds; 0 = never.",
        minimum=0,
    ),
    Setting(
        "models[].embeddings", BOOL, False,
        "Serve embeddings (`POST /v1/embeddings`) from this model: it gets an embeddings context of its own, counted "
        "by the ledger like any other, with the pooling its GGUF names (mean pooling when it names none).",
        live=False,
    ),
    Setting(
        "models[].reasoning", STR, "split",
        "What a template's `<think>…</think>` becomes: `split` = returned apart from the answer (OpenAI "
        "`reasoning_content`, Responses `reasoning` items, Anthropic `thinking` blocks); `inline` = left in the "
        "answer's text.",
        choices=("split", "inline"),
    ),
    Setting(
        "models[].cache_type", STR, "f16",
        "KV cache element type.",
        choices=_CACHE_TYPES, live=False,
    ),
    # models[].generate_if_missing
    Setting(f"{_GEN}.layers", INT, REQUIRED, "Transformer layers.", minimum=1, maximum=64),
    Setting(
        f"{_GEN}.dim", INT, REQUIRED,
        "Embedding width (dim // 64 heads).",
        minimum=32, maximum=4096, check=_check_tiny_dim,
    ),
    Setting(f"{_GEN}.seed", INT, 0, "Random seed.", minimum=0, maximum=2**32 - 1),
)

BY_KEY: dict[str, Setting] = {setting.key: setting for setting in SETTINGS}
SECTION_BY_KEY: dict[str, Section] = {section.key: section for section in SECTIONS}


def members(section: str) -> tuple[dict[str, Setting], dict[str, Section]]:
    """The settings and sub-sections directly inside ``section`` (``""`` = top level), by name."""
    settings: dict[str, Setting] = {}
    for setting in SETTINGS:
        if setting.section == section:
            settings[setting.name] = setting
    subsections: dict[str, Section] = {}
    for sub in SECTIONS:
        if sub.section == section:
            subsections[sub.name] = sub
    return settings, subsections


# --- rendering -------------------------------------------------------------------------------------------------------


def render_help() -> str:
    """Plain text, one setting per line, for ``--help`` and ``appliance config check``."""
    width = max(len(setting.key) for setting in SETTINGS)
    lines = []
    for setting in SETTINGS:
        default = "required" if setting.required else "default: " + show(setting.default, quote=False)
        lines.append(f"  {setting.key:<{width}}  {setting.describe()} [{default}]")
    return "\n".join(lines)


_DOCS_INTRO: list[str] = [
    "# Configuration reference",
    "",
    "<!-- Generated by appliance.config.schema.render_docs(); do not edit: "
    "python -m appliance.config.schema > docs/configuration.md -->",
    "",
    "The appliance reads one YAML file, `appliance.yaml`. Every key may be omitted and takes its default, "
    "except those marked *required*. Unknown keys, wrong types and out-of-range values are errors, "
    "reported all at once with their line (`appliance config check FILE`).",
    "",
    "- **size**: bytes, or a string like `8GiB`, `512 MiB` (binary: Ki, Mi, Gi, Ti = powers of 1024) or "
    "`2G`, `1.5GB` (decimal: K, M, G, T = powers of 1000); case-insensitive, fractions round down.",
    "- **path**: `~` expands; relative paths resolve against the config file's folder; one starting "
    f"with `{DATA_DIR_PREFIX}/` (quote it in YAML) against `data_dir`.",
    "- **device**: `auto` (NVML GPU 0 if present, else host), `host` (RAM), `nvml:N`, or `fake:<size>` "
    "(a simulated device of that size, for tests).",
    "- **octal mode**: write it quoted, `\"0660\"`; bits for others are refused.",
    "- **live**: *yes* = a reload applies a change without a restart (model keys: without reloading "
    "the weights).",
    "",
]


def _docs_row(setting: Setting) -> str:
    """The reference table's row for ``setting``."""
    default = "*required*" if setting.required else f"`{show(setting.default, quote=False)}`"
    live = "yes" if setting.live else "no"
    cells = [f"`{setting.key}`", setting.kind.name, default, live, setting.describe()]
    escaped = [cell.replace("|", "\\|") for cell in cells]
    return "| " + " | ".join(escaped) + " |"


def _docs_group(key: str, title: str, text: str) -> list[str]:
    """The heading, text and settings table of the section ``key`` (``""``: the top level)."""
    lines = [f"## {title}", ""]
    if text:
        lines += [text, ""]
    lines.append("| Key | Type | Default | Live | Description |")
    lines.append("|---|---|---|---|---|")
    for setting in SETTINGS:
        if setting.section == key:
            lines.append(_docs_row(setting))
    lines.append("")
    return lines


def render_docs() -> str:
    """Markdown reference of every setting (key path, type, default, live, help); the whole of
    ``docs/configuration.md``."""
    lines = list(_DOCS_INTRO)
    lines += _docs_group("", "Top level", "")
    for section in SECTIONS:
        text = section.help
        if section.many:
            text += " A list."
        if section.optional:
            text += " Optional."
        lines += _docs_group(section.key, f"`{section.key}`", text)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_docs(), end="")
