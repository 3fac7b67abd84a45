"""Memory devices (SPEC L1): what the ledger's cap is a share of, read from NVML, the host, or a fake.

Each device answers :meth:`MemoryDevice.read` with a :class:`DeviceReading` in bytes. :func:`parse_device_spec`
is pure; :func:`open_device` is the IO edge. Sizes (``fake:<size>``, :class:`FakeDevice`'s total) follow the
config's one rule, :func:`appliance.config.schema.parse_size`: K/M/G/T powers of 1000, Ki/Mi/Gi/Ti powers of 1024.

Device specs: ``auto`` (NVML GPU 0 when NVML initialises and reports at least one GPU, else ``host``),
``host``, ``nvml:N`` (GPU index N), ``fake:<size>`` (e.g. ``fake:8GiB``, for tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from appliance.config.schema import parse_size
from appliance.daemon import hostkv
from appliance.daemon.ledger import MAX_BYTES
from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

DeviceKind = Literal["nvml", "host", "fake"]


@dataclass(frozen=True)
class DeviceReading:
    """One sample of a device, in bytes; ``process_used`` is this process's use of it, None when unknown."""

    name: str
    kind: DeviceKind
    total: int
    used: int
    free: int
    process_used: int | None


class MemoryDevice(Protocol):
    name: str
    kind: DeviceKind

    def read(self) -> DeviceReading: ...

    def close(self) -> None: ...


def process_bytes(reading: DeviceReading) -> int:
    """This process's footprint on the device, or its RSS when the device cannot tell."""
    if reading.process_used is not None:
        return reading.process_used
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def physical_memory() -> int:
    """Physical RAM in bytes: ``MemTotal`` of ``/proc/meminfo``, else ``sysconf``."""
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as fh:
            total = hostkv.meminfo_total(fh.read())
        if total is not None:
            return total
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# -- NVML ---------------------------------------------------------------------------------------------------

_nvml_lock = threading.Lock()
_nvml_ready = False
NVML_LIBRARY = "libnvidia-ml.so.1"
"""The NVIDIA driver's NVML library, by the name pynvml loads it on Linux."""


def nvml_library_loads() -> bool:
    """Whether the NVIDIA driver's NVML library loads; without it NVML can report no GPU."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return False
    return True


def _nvml_init() -> None:
    """Initialise NVML once per process (kept until exit); raise ``pynvml.NVMLError``, not cached."""
    import pynvml  # lazy: pynvml is about 2 MiB of Python objects, and only an NVML device uses it

    global _nvml_ready
    with _nvml_lock:
        if not _nvml_ready:
            pynvml.nvmlInit()
            _nvml_ready = True


def gpu_visible() -> bool:
    """True when NVML initialises and reports at least one GPU. Never raises.

    Without the driver's NVML library the answer is False before pynvml is imported (a CPU-only box never loads
    it)."""
    if not nvml_library_loads():
        return False
    import pynvml  # lazy: see _nvml_init

    try:
        _nvml_init()
        return pynvml.nvmlDeviceGetCount() >= 1
    except (pynvml.NVMLError, OSError):
        return False


class NvmlDevice:
    """An NVIDIA GPU read through NVML; failing to open raises ``ApplianceError("INTERNAL")`` naming it."""

    kind: DeviceKind = "nvml"

    def __init__(self, index: int) -> None:
        import pynvml  # lazy: see _nvml_init

        self.index = index
        self.spec = f"nvml:{index}"
        try:
            _nvml_init()
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise ApplianceError("INTERNAL",
                                     f"cannot open memory device {self.spec}: NVML reports {count} GPU(s)",
                                     {"device": self.spec, "gpu_count": count})
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            raw = pynvml.nvmlDeviceGetName(self._handle)
        except pynvml.NVMLError as exc:
            raise ApplianceError("INTERNAL", f"cannot open memory device {self.spec}: NVML: {exc}",
                                 {"device": self.spec, "nvml_error": str(exc)}) from exc
        self.name = f"{self.spec} {raw.decode() if isinstance(raw, bytes) else raw}"
        self._closed = False

    def _process_used(self) -> int | None:
        """Bytes of this GPU used by processes with our pid; None when NVML cannot say (any NVML error).

        None also when our pid is not listed: in a container NVML lists host pids, so absence proves nothing.
        """
        import pynvml  # lazy: see _nvml_init

        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError):  # NotSupported, NoPermission, old driver
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
        if not mine or any(used is None for used in mine):
            return None
        return sum(mine)

    def read(self) -> DeviceReading:
        if self._closed:
            raise ApplianceError("INTERNAL", f"memory device {self.spec} is closed", {"device": self.spec})
        import pynvml  # lazy: see _nvml_init

        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            process_used = self._process_used()
        except pynvml.NVMLError as exc:  # the operator's log has NVML's reason; a client gets none of it
            log.error("cannot read memory device %s: NVML: %s", self.spec, exc)
            raise ApplianceError("INTERNAL", f"cannot read memory device {self.spec}",
                                 {"device": self.spec}) from exc
        return DeviceReading(self.name, "nvml", int(mem.total), int(mem.used), int(mem.free), process_used)

    def close(self) -> None:
        """Stop using the handle (NVML itself stays initialised for the process)."""
        self._closed = True


# -- host RAM -----------------------------------------------------------------------------------------------

def _kib_field(path: Path, field: str) -> int:
    """The ``<field>: <n> kB`` line of a /proc file, in bytes."""
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key == field:
            return int(rest.split()[0]) * 1024
    raise ValueError(f"{path} has no {field} line")


class HostDevice:
    """System RAM, from Linux /proc (cgroup limits are not applied): total = MemTotal, free = MemAvailable,
    used = total - free, process_used = this process's VmRSS."""

    kind: DeviceKind = "host"

    def __init__(self, meminfo: Path = Path("/proc/meminfo"),
                 status: Path = Path("/proc/self/status")) -> None:
        self.name = "host"
        self._meminfo = meminfo
        self._status = status
        try:  # fail at open (the operator sees why), not at first use
            self._reading()
        except (OSError, ValueError, IndexError) as exc:
            raise ApplianceError("INTERNAL", f"cannot read memory device host: {exc}", {"device": "host"}) from exc

    def _reading(self) -> DeviceReading:
        total = _kib_field(self._meminfo, "MemTotal")
        available = min(total, _kib_field(self._meminfo, "MemAvailable"))
        rss = _kib_field(self._status, "VmRSS")
        return DeviceReading(self.name, "host", total, total - available, available, rss)

    def read(self) -> DeviceReading:
        try:
            return self._reading()
        except (OSError, ValueError, IndexError) as exc:  # the log has the reason; a client gets none of it
            log.error("cannot read memory device host: %s", exc)
            raise ApplianceError("INTERNAL", "cannot read memory device host", {"device": "host"}) from exc

    def close(self) -> None:
        pass


# -- fake ---------------------------------------------------------------------------------------------------

class FakeDevice:
    """A device of ``total`` bytes (an int or a :func:`parse_size` string) whose ``used`` (everyone's use,
    ours included) and ``process_used`` tests set at will; reads and sets are atomic."""

    kind: DeviceKind = "fake"

    def __init__(self, total: int | str, used: int = 0, process_used: int | None = None) -> None:
        self.name = "fake"
        self._lock = threading.Lock()
        self.total = parse_size(total)
        if self.total > MAX_BYTES:
            raise ValueError(f"a device size must be at most {MAX_BYTES} bytes, got {total!r}")
        self.set_used(used)
        self.set_process_used(process_used)

    def set_used(self, used: int) -> None:
        """Set the device's used bytes (0..total), e.g. to simulate another process growing."""
        if type(used) is not int or not 0 <= used <= self.total:
            raise ValueError(f"used must be an int between 0 and {self.total}, got {used!r}")
        with self._lock:
            self._used = used

    def set_process_used(self, process_used: int | None) -> None:
        if process_used is not None and (type(process_used) is not int or process_used < 0):
            raise ValueError(f"process_used must be None or a non-negative int, got {process_used!r}")
        with self._lock:
            self._process_used = process_used

    def read(self) -> DeviceReading:
        with self._lock:
            return DeviceReading(self.name, "fake", self.total, self._used, self.total - self._used,
                                 self._process_used)

    def close(self) -> None:
        pass


# -- specs --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device spec: ``kind`` is auto/host/nvml/fake; ``index`` for nvml, ``size`` for fake."""

    kind: Literal["auto", "host", "nvml", "fake"]
    index: int | None = None
    size: int | None = None


_SPEC_HELP = "expected auto, host, nvml:N (N = GPU index, e.g. nvml:0) or fake:<size> (e.g. fake:8GiB)"


def parse_device_spec(spec: str) -> DeviceSpec:
    """Parse a device spec without opening anything; ``ValueError`` with the accepted forms otherwise."""
    if not isinstance(spec, str):
        raise ValueError(f"device spec must be a string, got {spec!r}; {_SPEC_HELP}")
    text = spec.strip()
    if text in ("auto", "host"):
        return DeviceSpec("auto" if text == "auto" else "host")
    prefix, sep, arg = text.partition(":")
    if sep and prefix == "nvml" and re.fullmatch(r"\d+", arg):
        return DeviceSpec("nvml", index=int(arg))
    if sep and prefix == "fake":
        try:
            return DeviceSpec("fake", size=parse_size(arg))
        except ValueError as exc:
            raise ValueError(f"bad device spec {spec!r}: {exc}") from exc
    raise ValueError(f"bad device spec {spec!r}; {_SPEC_HELP}")


def open_device(spec: str) -> MemoryDevice:
    """Open the device ``spec`` names (see the module docstring).

    Raises ``ValueError`` for a malformed spec and ``ApplianceError("INTERNAL")`` when the device cannot be
    opened (e.g. ``nvml:0`` on a box without an NVIDIA driver).
    """
    parsed = parse_device_spec(spec)
    if parsed.kind == "auto":
        return NvmlDevice(0) if gpu_visible() else HostDevice()
    if parsed.kind == "host":
        return HostDevice()
    if parsed.kind == "nvml" and parsed.index is not None:
        return NvmlDevice(parsed.index)
    assert parsed.size is not None
    return FakeDevice(parsed.size)
