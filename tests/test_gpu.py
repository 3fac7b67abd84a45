"""On a real NVIDIA GPU (the ``gpu`` marker: ``pytest -m gpu``; ``scripts/gpu-check.sh`` builds llama-cpp-python
with CUDA first and runs them): the NVML device reads what ``nvidia-smi`` reads; a model with every layer offloaded
uses no more VRAM than the ledger's estimate (measured by ``nvidia-smi``) and at least its blocks' weights;
``n_gpu_layers: auto`` takes as many layers as the ledger's free bytes hold, fewer when ``admission_percent`` is
lowered; an agent's KV state swapped out of VRAM and back continues exactly; a CPU build on a GPU runs on the CPU and
counts only the compute margin against VRAM. Without an NVIDIA GPU (or, for the offload tests, without a CUDA build)
they skip and say why.

With ``APPLIANCE_GPU_REPORT=FILE`` each test appends its figures to FILE as one JSON line (gpu-check's summary)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import running

from appliance.client import lines as lineclient
from appliance.daemon.devices import NvmlDevice, gpu_visible
from appliance.engine import gguf_meta, gpubuild
from appliance.engine.gguf_meta import ModelShape, read_model_shape
from appliance.engine.interface import Sampling
from appliance.protocol import lines

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
GIB = 1024 * MIB
UP_S = 120
N_CTX = 512  # small: llama.cpp's compute buffers grow with n_ctx x n_ubatch, and these tests are about the weights
SMI_TOLERANCE = 64 * MIB  # between two reads a moment apart, on a GPU no one else uses
GPU = gpu_visible()
OFFLOADS = GPU and gpubuild.offload_supported()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="no NVIDIA GPU visible through NVML here")]
needs_cuda_build = pytest.mark.skipif(GPU and not OFFLOADS, reason="llama-cpp-python here cannot offload (a CPU "
                                      "build): APPLIANCE_GPU=cuda scripts/setup.sh builds one that can")
needs_smi = pytest.mark.skipif(GPU and shutil.which("nvidia-smi") is None, reason="nvidia-smi is not on PATH")
# (each mark checks GPU first, so that a machine without one is told that, once, by the module's mark)


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``report(**figures)``: appended as a JSON line to ``$APPLIANCE_GPU_REPORT`` when set."""
    path = os.environ.get("APPLIANCE_GPU_REPORT")

    def write(**figures: Any) -> None:
        if path:
            with open(path, "a") as out:
                out.write(json.dumps({"test": request.node.name, **figures}) + "\n")

    return write


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of 2048-wide layers (about 98 MiB each), 2.5 % of the GPU's memory (at least 1 GiB): big
    enough that the smallest admission_percent (1) leaves room for about half of its layers."""
    total = NvmlDevice(0).read().total
    layers = max(8, math.ceil(max(GIB, total // 40) / (98 * MIB)))
    from appliance.engine.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("gpu") / "big.gguf", layers=layers, dim=2048, seed=7)


# -- nvidia-smi ------------------------------------------------------------------------------------------------------

def smi(*arguments: str) -> list[list[str]]:
    """``nvidia-smi`` CSV rows (no header, no units) for GPU 0."""
    result = subprocess.run(["nvidia-smi", *arguments, "--format=csv,noheader,nounits", "-i", "0"],
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"nvidia-smi {' '.join(arguments)}: {result.stdout}{result.stderr}".strip())
    return [[cell.strip() for cell in line.split(",")] for line in result.stdout.splitlines() if line.strip()]


def smi_memory() -> dict[str, int]:
    """GPU 0's memory in bytes as nvidia-smi reads it: total, used, free, and reserved (0 where the driver has no
    such field)."""
    try:
        (row,) = smi("--query-gpu=memory.total,memory.used,memory.free,memory.reserved")
    except RuntimeError:  # an older driver: no memory.reserved
        (row,) = smi("--query-gpu=memory.total,memory.used,memory.free")
        row.append("0")
    return dict(zip(("total", "used", "free", "reserved"), (int(cell) * MIB for cell in row), strict=True))


def vram_of(pid: int) -> tuple[int, str]:
    """The VRAM nvidia-smi counts for ``pid`` (``process``), or the whole GPU's used memory (``device``) where it
    lists no such process (in a container it lists the host's pids)."""
    for row in smi("--query-compute-apps=pid,used_memory"):
        if row[0] == str(pid) and row[1].isdigit():
            return int(row[1]) * MIB, "process"
    return smi_memory()["used"], "device"


# -- a real appliance process on the GPU -----------------------------------------------------------------------------

class Process:
    def __init__(self, folder: Path, proc: subprocess.Popen[str]) -> None:
        self.folder = folder
        self.proc = proc
        self.output = ""

    def line(self, text: str) -> str:
        reply = lineclient.request(self.folder / "appliance.sock", text, 300)
        assert reply.startswith("OK "), (text, reply)
        return reply

    def status(self) -> dict[str, Any]:
        body = lines.parse_reply(self.line("STATUS")).body or ""
        records: dict[str, Any] = {"model": {}}
        for line in body.splitlines():
            kind, _, fields = line.partition(" ")
            if kind == "model":
                record = lines.parse_fields(fields)
                records["model"][record["name"]] = record
            elif kind in ("ledger", "device"):
                records[kind] = lines.parse_fields(fields)
        return records


@contextmanager
def appliance(models: dict[str, dict[str, Any]], **settings: Any) -> Iterator[Process]:
    """``appliance run`` on GPU 0 (``device: nvml:0``) in a process of its own, with the fixed engine strategy (a
    context of the full ``n_ctx``: the ledger's figure is the estimate's) and no resync (the cap stays as at start)."""
    folder = Path(tempfile.mkdtemp(prefix="ag-"))
    document = {"data_dir": str(folder), "device": "nvml:0", "http": {"port": 0}, "resync_interval_s": 0,
                "engine": {"adaptive": False}, "models": [{"name": name, **spec} for name, spec in models.items()],
                **settings}
    (folder / "appliance.yaml").write_text(yaml.safe_dump(document))
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(folder / "appliance.yaml")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running_one = Process(folder, proc)
    try:
        deadline = time.monotonic() + UP_S
        while not (folder / "registry.json").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the daemon did not come up"
            time.sleep(0.1)
        yield running_one
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        running_one.output = proc.communicate(timeout=120)[0]
        shutil.rmtree(folder, ignore_errors=True)


# -- the NVML device -------------------------------------------------------------------------------------------------

@needs_smi
def test_the_nvml_device_reads_what_nvidia_smi_reads(report: Callable[..., None]) -> None:
    device = NvmlDevice(0)
    try:
        reading = device.read()
        smi_read = smi_memory()
    finally:
        device.close()
    report(nvml_total=reading.total, nvml_used=reading.used, nvml_free=reading.free, smi=smi_read)
    assert abs(reading.total - smi_read["total"]) < MIB  # nvidia-smi rounds down to whole MiB
    assert abs(reading.free - smi_read["free"]) <= SMI_TOLERANCE
    # NVML's used counts the driver's reserved memory; newer nvidia-smi shows it apart
    assert min(abs(reading.used - smi_read["used"]), abs(reading.used - smi_read["used"] - smi_read["reserved"])) \
        <= SMI_TOLERANCE


# -- the ledger against the GPU --------------------------------------------------------------------------------------

def warmed(app: Process) -> None:
    """Load the small ``warm`` model and decode with it: the daemon's CUDA context and cuBLAS come up with the first
    model, and are not what the ledger's estimate of the next one counts."""
    app.line("REGISTER w warm")
    app.line("DECODE w 4 Hello")


def measured_load(app: Process, agent: str, model: str) -> tuple[int, str]:
    """The VRAM (nvidia-smi's) that registering ``agent`` on ``model`` and a decode add, and whose figure it is."""
    before, source = vram_of(app.proc.pid)
    app.line(f"REGISTER {agent} {model}")
    app.line(f"DECODE {agent} 4 Hello there, how are you")
    after, source_after = vram_of(app.proc.pid)
    assert source == source_after
    return after - before, source


@needs_cuda_build
@needs_smi
@pytest.mark.parametrize("asked", ["all", "half", "none"])
def test_the_vram_a_model_uses_is_within_the_ledgers_figure(asked: str, tiny_model: Path, big_model: Path,
                                                            report: Callable[..., None]) -> None:
    shape = read_model_shape(big_model)
    layers = shape.offload_layers
    gpu_layers = {"all": layers, "half": shape.layers // 2, "none": 0}[asked]
    models = {"warm": {"path": str(tiny_model), "n_gpu_layers": -1, "n_ctx": N_CTX},
              "big": {"path": str(big_model), "n_gpu_layers": -1 if asked == "all" else gpu_layers, "n_ctx": N_CTX}}
    with appliance(models) as app:
        warmed(app)
        measured, source = measured_load(app, "b", "big")
        record = app.status()["model"]["big"]
    ledger = int(record["estimate_bytes"])
    table = gguf_meta.estimate(shape, N_CTX, "f16", gpu_layers)
    offloaded_blocks = sum(shape.block_bytes[shape.layers - min(gpu_layers, shape.layers):])
    report(measured_bytes=measured, measured_by=source, ledger_bytes=ledger, blocks_bytes=offloaded_blocks,
           gpu_layers=record["gpu_layers"], ratio=round(measured / ledger, 3))
    assert (record["gpu_layers"], record["host_bytes"]) == (f"{gpu_layers}/{layers}", str(table.host))
    assert record["processor"] == {"all": "GPU", "half": "CPU/GPU", "none": "CPU"}[asked]
    assert ledger == table.total  # every layer: the old figure; fewer: their weights and KV, and the margin
    if asked == "all":
        assert ledger == gguf_meta.estimate(shape, N_CTX).total
    assert offloaded_blocks <= measured <= ledger, (measured, ledger)


@needs_cuda_build
def test_auto_offloads_fewer_layers_when_admission_percent_is_lowered(tiny_model: Path, big_model: Path,
                                                                      report: Callable[..., None]) -> None:
    shape = read_model_shape(big_model)
    layers = shape.offload_layers
    device_bytes = gguf_meta.device_bytes_by_layers(shape, N_CTX)
    warm_bytes = gguf_meta.estimate(read_model_shape(tiny_model), N_CTX).total
    models = {"warm": {"path": str(tiny_model), "n_gpu_layers": -1, "n_ctx": N_CTX},
              "big": {"path": str(big_model), "n_gpu_layers": "auto", "n_ctx": N_CTX}}
    with appliance(models, admission_percent=90) as app:
        app.line("REGISTER a big")
        roomy = app.status()["model"]["big"]
    assert (roomy["gpu_layers"], roomy["processor"], roomy["offload_note"]) == (f"{layers}/{layers}", "GPU", "none")

    reading = NvmlDevice(0).read()
    target = (device_bytes[layers // 2] + device_bytes[layers // 2 + 1]) // 2  # room for about half the layers
    percent = math.ceil(100 * 1000 * (reading.used + warm_bytes + target) / reading.total) / 1000
    if percent < 1:
        pytest.skip(f"half of the test model is under 1 % of this GPU's {reading.total} bytes")
    with appliance(models, admission_percent=percent) as app:
        warmed(app)
        ledger_now = app.status()["ledger"]
        free = int(ledger_now["cap_bytes"]) - int(ledger_now["allocated_bytes"])
        measured, source = measured_load(app, "a", "big")
        tight = app.status()["model"]["big"]
    chosen = int(tight["gpu_layers"].split("/")[0])
    ledger = int(tight["estimate_bytes"])
    report(admission_percent=percent, cap_bytes=free, roomy=roomy["gpu_layers"], tight=tight["gpu_layers"],
           ledger_bytes=ledger, host_bytes=int(tight["host_bytes"]), measured_bytes=measured, measured_by=source)
    assert 0 < chosen < layers and tight["processor"] == "CPU/GPU"
    assert chosen == max(n for n, needed in enumerate(device_bytes) if needed <= free)  # the most that fit
    assert ledger == device_bytes[chosen] <= free
    assert int(tight["host_bytes"]) == gguf_meta.estimate(shape, N_CTX, "f16", chosen).host > 0
    assert tight["offload_note"] == f"auto: {chosen} of {layers} layers fit in the ledger's {free} free bytes"
    assert sum(shape.block_bytes[shape.layers - min(chosen, shape.layers):]) <= measured <= ledger


# -- KV swap out of VRAM and back ------------------------------------------------------------------------------------

def _tokens(app, agent: str, n: int, prompt: str) -> tuple[list[int], Any]:  # type: ignore[no-untyped-def]
    result = app.call(app.daemon.decode(agent, n, prompt, Sampling()))
    return list(result.generation.tokens), result


@needs_cuda_build
def test_a_kv_swap_out_of_vram_and_back_continues_exactly(tiny_model: Path, report: Callable[..., None]) -> None:
    models = {"tiny": {"path": str(tiny_model), "n_gpu_layers": -1}}
    with running(models, model_dirs=[tiny_model.parent], device="nvml:0", engine={"live_slots": 1}) as app:
        for agent in ("ref", "a", "b"):
            app.line(f"REGISTER {agent} tiny")
        reference, _ = _tokens(app, "ref", 32, "Hello world")
        first, r1 = _tokens(app, "a", 16, "Hello world")
        _, rb = _tokens(app, "b", 16, "Something else entirely")
        second, r2 = _tokens(app, "a", 16, "")
        record = next(m for m in app.daemon.snapshot()["models"] if m["name"] == "tiny")
        swapped = app.daemon.counters["kv_swap_bytes"]
    report(gpu_layers=record["gpu_layers"], kv_swap_bytes=swapped, tokens_equal=first + second == reference)
    assert record["gpu_layers"] == "5/5" and record["processor"] == "GPU"
    assert (r1.evicted, rb.evicted, r2.evicted, r2.restored) == ("ref", "a", "b", True)
    assert first + second == reference


# -- a CPU build on a GPU --------------------------------------------------------------------------------------------

@pytest.mark.skipif(OFFLOADS, reason="this llama-cpp-python offloads: the CPU build's fallback is not what runs here")
def test_a_cpu_build_on_a_gpu_runs_on_the_cpu_and_counts_only_the_compute_margin(tiny_model: Path) -> None:
    models = {"tiny": {"path": str(tiny_model), "n_gpu_layers": -1}}
    with running(models, model_dirs=[tiny_model.parent], device="nvml:0", engine={"adaptive": False}) as app:
        app.line("REGISTER a tiny")
        record = next(m for m in app.daemon.snapshot()["models"] if m["name"] == "tiny")
    shape: ModelShape = read_model_shape(tiny_model)
    nothing = gguf_meta.estimate(shape, 2048, "f16", 0)
    assert (record["gpu_layers"], record["processor"]) == ("0/5", "CPU")
    assert "built without GPU support" in record["offload_note"]
    assert record["estimate_bytes"] == nothing.total and record["host_bytes"] == nothing.host
