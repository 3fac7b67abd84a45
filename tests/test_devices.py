from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from appliance.daemon import devices
from appliance.daemon.devices import (
    DeviceReading,
    DeviceSpec,
    FakeDevice,
    HostDevice,
    NvmlDevice,
    gpu_visible,
    open_device,
    parse_device_spec,
)
from appliance.daemon.ledger import MAX_BYTES
from appliance.errors import ApplianceError

GIB = 2**30
GPU = gpu_visible()
def needs_gpu(test):  # type: ignore[no-untyped-def]
    """A test of the real NVML device: in the ``gpu`` set (``pytest -m gpu``), skipped without a GPU."""
    skip = pytest.mark.skipif(not GPU, reason="no NVIDIA GPU visible through NVML on this machine")
    return pytest.mark.gpu(skip(test))


needs_no_gpu = pytest.mark.skipif(GPU, reason="an NVIDIA GPU is visible; this checks the CPU-only fallback")


def _meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


# -- FakeDevice ---------------------------------------------------------------------------------------------

def test_fake_device_readings() -> None:
    dev = FakeDevice(8 * GIB)
    assert dev.read() == DeviceReading("fake", "fake", 8 * GIB, 0, 8 * GIB, None)
    dev.set_used(3 * GIB)  # another process grows
    reading = dev.read()
    assert (reading.total, reading.used, reading.free) == (8 * GIB, 3 * GIB, 5 * GIB)
    dev.set_process_used(GIB)
    assert dev.read().process_used == GIB
    dev.set_used(8 * GIB)
    assert dev.read().free == 0
    dev.close()


def test_fake_device_from_size_string_and_initial_values() -> None:
    dev = FakeDevice("1GiB", used=100, process_used=40)
    assert dev.read() == DeviceReading("fake", "fake", GIB, 100, GIB - 100, 40)


@pytest.mark.parametrize("total", [-1, "8XB", True, None, MAX_BYTES + 1, "99999999TiB"])
def test_fake_device_rejects_bad_total(total: object) -> None:
    with pytest.raises(ValueError):
        FakeDevice(total)  # type: ignore[arg-type]


@pytest.mark.parametrize("used", [-1, 8 * GIB + 1, 1.0, None])
def test_fake_device_rejects_bad_used(used: object) -> None:
    dev = FakeDevice(8 * GIB, used=5)
    with pytest.raises(ValueError):
        dev.set_used(used)  # type: ignore[arg-type]
    assert dev.read().used == 5
    with pytest.raises(ValueError):
        dev.set_process_used(-1)


def test_fake_device_reads_are_consistent_under_concurrent_sets() -> None:
    dev = FakeDevice(1000)
    stop = threading.Event()
    bad: list[DeviceReading] = []

    def reader() -> None:
        while not stop.is_set():
            r = dev.read()
            if r.used + r.free != r.total:
                bad.append(r)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(5000):
        dev.set_used(i % 1001)
    stop.set()
    t.join()
    assert bad == []


# -- HostDevice ---------------------------------------------------------------------------------------------

def test_host_device_numbers_are_sane() -> None:
    dev = HostDevice()
    r = dev.read()
    assert r.kind == "host" and r.name == "host"
    assert r.total == _meminfo_kib("MemTotal") * 1024
    assert 0 < r.used <= r.total
    assert r.used + r.free == r.total
    assert 0 < r.free <= r.total
    assert r.process_used is not None and r.process_used > 0
    assert r.process_used < r.total
    dev.close()


def test_host_device_process_used_tracks_rss() -> None:
    dev = HostDevice()
    before = dev.read().process_used
    blob = bytearray(64 * 2**20)  # 64 MiB, touched (zeroed) by the allocator
    for i in range(0, len(blob), 4096):
        blob[i] = 1
    after = dev.read().process_used
    assert before is not None and after is not None
    assert after - before >= 48 * 2**20
    del blob


def test_host_device_arithmetic_from_files(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    status = tmp_path / "status"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    300 kB\n")
    status.write_text("Name:\tpython\nVmRSS:\t      50 kB\n")
    r = HostDevice(meminfo, status).read()
    assert r == DeviceReading("host", "host", 1000 * 1024, 700 * 1024, 300 * 1024, 50 * 1024)


def test_host_device_unreadable_is_a_clear_error(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\n")  # no MemAvailable
    with pytest.raises(ApplianceError) as info:
        HostDevice(meminfo)
    assert info.value.code == "INTERNAL"
    assert "MemAvailable" in info.value.message
    with pytest.raises(ApplianceError):
        HostDevice(tmp_path / "missing")


# -- specs and open_device ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "expected"), [
    ("auto", DeviceSpec("auto")),
    ("host", DeviceSpec("host")),
    (" host ", DeviceSpec("host")),
    ("nvml:0", DeviceSpec("nvml", index=0)),
    ("nvml:3", DeviceSpec("nvml", index=3)),
    ("fake:8GiB", DeviceSpec("fake", size=8 * GIB)),
    ("fake:1000", DeviceSpec("fake", size=1000)),
    ("fake:2G", DeviceSpec("fake", size=2 * 10**9)),  # the config's size rule (settings.parse_size): G = 10**9
    ("fake: 512 MiB", DeviceSpec("fake", size=512 * 2**20)),
])
def test_parse_device_spec(spec: str, expected: DeviceSpec) -> None:
    assert parse_device_spec(spec) == expected


@pytest.mark.parametrize("spec", ["", "gpu", "cuda:0", "nvml", "nvml:", "nvml:-1", "nvml:x", "nvml:0:1",
                                  "fake", "fake:", "fake:lots", "HOST", "hostx", None, 0])
def test_bad_device_specs(spec: object) -> None:
    with pytest.raises(ValueError) as info:
        open_device(spec)  # type: ignore[arg-type]
    assert "nvml:N" in str(info.value) or "size like" in str(info.value)


def test_open_fake_device() -> None:
    dev = open_device("fake:8GiB")
    assert isinstance(dev, FakeDevice)
    assert dev.read() == DeviceReading("fake", "fake", 8 * GIB, 0, 8 * GIB, None)


def test_open_host_device() -> None:
    dev = open_device("host")
    assert isinstance(dev, HostDevice)
    assert dev.read().total == _meminfo_kib("MemTotal") * 1024


def test_gpu_visible_is_a_bool_and_open_auto_agrees() -> None:
    assert isinstance(gpu_visible(), bool)
    dev = open_device("auto")
    try:
        assert dev.kind == ("nvml" if GPU else "host")
    finally:
        dev.close()


@needs_no_gpu
def test_auto_falls_back_to_host_without_gpu() -> None:
    assert isinstance(open_device("auto"), HostDevice)


@needs_no_gpu
def test_nvml_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(ApplianceError) as info:
        open_device("nvml:0")
    assert info.value.code == "INTERNAL"
    assert "nvml:0" in info.value.message
    assert info.value.details["device"] == "nvml:0"


# -- NvmlDevice (real NVML; runs only on a GPU box) ---------------------------------------------------------

@needs_gpu
def test_nvml_device_reading() -> None:
    dev = NvmlDevice(0)
    r = dev.read()
    assert r.kind == "nvml" and r.name.startswith("nvml:0 ")
    assert r.total > 0
    assert 0 <= r.used <= r.total
    assert 0 <= r.free <= r.total
    assert r.process_used is None or 0 <= r.process_used <= r.used
    dev.close()
    with pytest.raises(ApplianceError):
        dev.read()


@needs_gpu
def test_nvml_auto_and_bad_index() -> None:
    dev = open_device("auto")
    assert isinstance(dev, NvmlDevice) and dev.index == 0
    with pytest.raises(ApplianceError) as info:
        open_device("nvml:4096")
    assert "nvml:4096" in info.value.message



# -- NvmlDevice's mapping of NVML answers, with NVML's functions stubbed (runs everywhere) -------------------

class _StubNvml:
    """Stands in for the NVML library calls only; NvmlDevice's own code runs unchanged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.procs: list[SimpleNamespace] | Exception = []
        self.mem: SimpleNamespace | Exception = SimpleNamespace(total=100 * GIB, used=40 * GIB, free=60 * GIB)
        monkeypatch.setattr(devices, "_nvml_ready", False)
        monkeypatch.setattr(devices, "nvml_library_loads", self.library_loads)
        for name, fn in {
            "nvmlInit": lambda: None,
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda i: ("handle", i),
            "nvmlDeviceGetName": lambda h: "NVIDIA Stub",
            "nvmlDeviceGetMemoryInfo": lambda h: self._answer(self.mem),
            "nvmlDeviceGetComputeRunningProcesses": lambda h: self._answer(self.procs),
        }.items():
            monkeypatch.setattr(pynvml, name, fn)

    @staticmethod
    def library_loads() -> bool:
        return True

    @staticmethod
    def _answer(value: object) -> object:
        if isinstance(value, Exception):
            raise value
        return value


def test_nvml_mapping_of_memory_and_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = _StubNvml(monkeypatch)
    stub.procs = [SimpleNamespace(pid=1, usedGpuMemory=GIB),
                  SimpleNamespace(pid=os.getpid(), usedGpuMemory=3 * GIB)]
    dev = open_device("auto")
    assert isinstance(dev, NvmlDevice)
    assert dev.read() == DeviceReading("nvml:0 NVIDIA Stub", "nvml", 100 * GIB, 40 * GIB, 60 * GIB, 3 * GIB)


@pytest.mark.parametrize("procs", [
    [],  # our pid not listed (nothing loaded yet, or a container's pid namespace): unknown
    [SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)],  # NVML could not say
    pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED),
    pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION),
])
def test_nvml_process_use_unknown(monkeypatch: pytest.MonkeyPatch, procs: object) -> None:
    stub = _StubNvml(monkeypatch)
    stub.procs = procs  # type: ignore[assignment]
    reading = NvmlDevice(0).read()
    assert reading.process_used is None
    assert reading.total == 100 * GIB


def test_nvml_errors_name_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = _StubNvml(monkeypatch)
    with pytest.raises(ApplianceError, match="nvml:1.*1 GPU"):
        NvmlDevice(1)
    dev = NvmlDevice(0)
    stub.mem = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(ApplianceError) as info:
        dev.read()
    assert info.value.code == "INTERNAL" and "nvml:0" in info.value.message
    assert "GPU is lost" not in info.value.message and info.value.details == {"device": "nvml:0"}  # log only
    driver_gone = pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: stub._answer(driver_gone))
    monkeypatch.setattr(devices, "_nvml_ready", False)
    assert gpu_visible() is False
    with pytest.raises(ApplianceError) as info:
        NvmlDevice(0)
    assert info.value.details["device"] == "nvml:0" and "nvml_error" in info.value.details
