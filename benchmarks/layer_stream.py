"""Layer streaming: copy layer i+1's weights while layer i computes (SPEC B4).

A model too big for its device can still run if its layers are streamed in: each layer's weights are copied in
just before they are used. Done naively (copy, compute, copy, compute, ...) the copies add to the time; with two
buffers the copy of layer i+1 runs while layer i computes, so it hides behind the compute. This script runs both
schedules over the same weights, the same bytes and the same compute, side by side, and reports the saving.

* **serial**: for each layer, load its weights into one buffer, then compute on them.
* **overlapped**: double-buffered; while layer i computes on buffer ``i % 2``, a second actor (a reader thread on
  the CPU path, a second CUDA stream on the GPU path) loads layer i+1 into the other buffer; the compute of i+1
  waits for that load.

The CPU path reads the layers from a file (``O_DIRECT`` when the filesystem allows it, so a read is a real
transfer from the disk and not a copy out of the page cache); the GPU path copies them from pinned host memory
to the device. A layer's compute is matmuls of slices of its weights (float32) with a small activation,
calibrated to take ``--compute-ratio`` times as long as its copy. Weights and activation are small integers, so
every product and sum is exact and the per-layer checksums of the two schedules must be equal (exit 1 if not).

Run ``python -m benchmarks.layer_stream`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from benchmarks.common import add_output_args, fill_defaults, finish, machine

NAME = "layer_stream"
SEED_SPEEDUP = 1.285
MIB = 2**20
ALIGN = 4096  # O_DIRECT wants buffers, offsets and lengths aligned to the logical block size; 4096 covers it
COLS = 1024  # a layer's weights are a float32 matrix of (layer bytes / 4 / COLS) rows x COLS
ACTIVATION_ROWS = 16  # the activation a layer multiplies: ACTIVATION_ROWS x COLS
VALUE_BOUND = 7  # weights and activation are integers in [-7, 7]: every dot product (<= 1024 * 49) is exact
CALIBRATION_SAMPLES = 5
UNIT_SLICES = 8  # a compute unit multiplies 1/UNIT_SLICES of a layer's rows
READ_MODES = ("O_DIRECT", "fadvise_dontneed", "page_cache")
CUDA_READ_MODE = "pinned_host_to_device"
OPENBLAS_THREAD_CALLS = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                         ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
                         ("openblas_set_num_threads", "openblas_get_num_threads"))

Load = Callable[[int, int], None]
"""Load a layer's weights into a buffer: ``load(layer, slot)``."""
Compute = Callable[[int, int], float]
"""Compute on the layer held in a buffer and return its checksum: ``compute(layer, slot)``."""


# -- the two schedules ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """One load or compute of one layer on one buffer (slot); start and end in seconds from the pass's start."""

    kind: str  # "load" or "compute"
    layer: int
    slot: int
    start: float
    end: float


@dataclass(frozen=True)
class Pass:
    """One run of every layer through a schedule: its wall time, each layer's checksum, and what ran when."""

    schedule: str  # "serial" or "overlapped"
    wall_s: float
    checksums: list[float]
    spans: list[Span]

    def mean_ms(self, kind: str) -> float:
        """The mean time of one layer's ``kind`` ("load" or "compute") in this pass, in ms."""
        return statistics.fmean(s.end - s.start for s in self.spans if s.kind == kind) * 1e3


def _timed(spans: list[Span], origin: float, kind: str, fn: Callable[[int, int], Any], layer: int,
           slot: int) -> Any:
    start = time.perf_counter()
    value = fn(layer, slot)
    end = time.perf_counter()
    spans.append(Span(kind, layer, slot, start - origin, end - origin))
    return value


def _check_layers(n_layers: int) -> None:
    if n_layers < 1:
        raise ValueError(f"a pass needs at least one layer, got {n_layers}")


def stream_serial(n_layers: int, load: Load, compute: Compute) -> Pass:
    """Each layer loaded into buffer 0, then computed on; nothing overlaps."""
    _check_layers(n_layers)
    spans: list[Span] = []
    checksums: list[float] = []
    origin = time.perf_counter()
    for layer in range(n_layers):
        _timed(spans, origin, "load", load, layer, 0)
        checksums.append(_timed(spans, origin, "compute", compute, layer, 0))
    return Pass("serial", time.perf_counter() - origin, checksums, spans)


def stream_overlapped(n_layers: int, load: Load, compute: Compute) -> Pass:
    """Double-buffered: a loader thread loads layer i+1 into buffer ``(i + 1) % 2`` while layer i computes on
    buffer ``i % 2``; the compute of a layer starts once its load has ended. A load's error is raised here."""
    _check_layers(n_layers)
    spans: list[Span] = []
    checksums: list[float] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-loader") as loader:
        origin = time.perf_counter()
        pending = loader.submit(_timed, spans, origin, "load", load, 0, 0)
        for layer in range(n_layers):
            pending.result()  # this layer's weights are in buffer layer % 2
            if layer + 1 < n_layers:
                # The other buffer is free: the compute that last read it (layer - 1) has returned.
                pending = loader.submit(_timed, spans, origin, "load", load, layer + 1, (layer + 1) % 2)
            checksums.append(_timed(spans, origin, "compute", compute, layer, layer % 2))
        wall = time.perf_counter() - origin
    return Pass("overlapped", wall, checksums, spans)


# -- the compute --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ComputePlan:
    """A layer's compute: ``units`` matmuls, each of the activation with ``rows`` rows of the layer's weights."""

    rows: int
    units: int


def compute_plan(copy_s: float, unit_s: float, rows: int, ratio: float) -> ComputePlan:
    """The plan whose time is about ``ratio`` x ``copy_s``: the unit of ``rows`` rows, which took ``unit_s``,
    repeated k times (at least once)."""
    if not (copy_s > 0 and unit_s > 0 and rows >= 1 and ratio > 0):
        raise ValueError(f"cannot plan a compute from copy {copy_s} s, unit {unit_s} s, {rows} rows, ratio {ratio}")
    return ComputePlan(rows=rows, units=max(1, round(ratio * copy_s / unit_s)))


def unit_rows(layer_rows: int, plan: ComputePlan, unit: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that compute unit ``unit`` multiplies: slices of ``plan.rows`` rows taken from
    the end of the layer backwards (so the first unit reads the bytes a load writes last), round and round."""
    if not 1 <= plan.rows <= layer_rows:
        raise ValueError(f"a unit of {plan.rows} rows does not fit a layer of {layer_rows} rows")
    slices = layer_rows // plan.rows
    index = slices - 1 - unit % slices
    return index * plan.rows, (index + 1) * plan.rows


def layer_values(layer: int, layer_bytes: int, seed: int) -> np.ndarray:
    """Layer ``layer``'s weights: float32 integers in [-VALUE_BOUND, VALUE_BOUND], one row of COLS per 4 KiB."""
    rng = np.random.default_rng([seed, layer])
    values = rng.integers(-VALUE_BOUND, VALUE_BOUND + 1, size=layer_bytes // 4, dtype=np.int8)
    return values.astype(np.float32).reshape(-1, COLS)


def activation_values(seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 1 << 30])
    values = rng.integers(-VALUE_BOUND, VALUE_BOUND + 1, size=(ACTIVATION_ROWS, COLS), dtype=np.int8)
    return values.astype(np.float32)


def numpy_checksum(weights: np.ndarray, activation: np.ndarray, plan: ComputePlan) -> float:
    """The sum of every output of the plan's matmuls on ``weights`` (exact: the values are small integers)."""
    total = 0.0
    for unit in range(plan.units):
        start, stop = unit_rows(weights.shape[0], plan, unit)
        out = activation @ weights[start:stop].T
        total += float(out.sum(dtype=np.float64))
    return total


def loaded_openblas() -> list[str]:
    """The OpenBLAS libraries this process has mapped (numpy's among them), from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "openblas" in Path(fields[5]).name.lower() and fields[5] not in found:
            found.append(fields[5])
    return found


@contextmanager
def blas_threads(n: int) -> Iterator[str]:
    """Inside the block numpy's OpenBLAS runs on ``n`` threads (0: as it is); yields what was done, in words.

    On a shared 2-core box a multi-threaded matmul waits for its second thread to get a core (a 0.2 ms matmul was
    seen taking 24 ms), and the loader thread needs a core too; one BLAS thread makes one core the compute."""
    if n == 0:
        yield "the library's default"
        return
    for library in loaded_openblas():
        lib = ctypes.CDLL(library)
        for set_name, get_name in OPENBLAS_THREAD_CALLS:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                set_threads = getattr(lib, set_name)
                set_threads.argtypes = [ctypes.c_int]
                set_threads.restype = None
                before = int(getattr(lib, get_name)())
                set_threads(n)
                try:
                    yield f"{n} (OpenBLAS; it had {before})"
                finally:
                    set_threads(before)
                return
    yield "the library's default (no OpenBLAS found to set)"


# -- a path: where the layers come from and where they compute ----------------------------------------------

@dataclass(frozen=True)
class Calibration:
    copy_ms: float  # one layer's load (median of CALIBRATION_SAMPLES)
    unit_ms: float  # one compute unit (median of CALIBRATION_SAMPLES sweeps of UNIT_SLICES units, per unit)
    target_compute_ms: float
    plan: ComputePlan


class LayerStream(Protocol):
    """One path (CPU or CUDA): it calibrates the compute, runs a pass of either schedule, and checks one layer
    against weights made in memory."""

    path: str
    read_mode: str

    def calibrate(self, ratio: float) -> Calibration: ...

    def run(self, schedule: str) -> Pass: ...

    def reference_checksum(self, layer: int) -> float: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def aligned_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes whose address is a multiple of ALIGN (a view into a slightly larger array)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + nbytes]


def weights_file(model_dir: Path, n_layers: int, layer_bytes: int, seed: int) -> Path:
    """The cached weights file of ``n_layers`` x ``layer_bytes`` (every parameter in its name), written once,
    atomically, synced to the disk and dropped from the page cache."""
    path = model_dir / f"layers-{n_layers}x{layer_bytes // MIB}MiB-f32-s{seed}.bin"
    size = n_layers * layer_bytes
    if path.is_file() and path.stat().st_size == size:
        return path
    model_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(model_dir).free
    if free < size + 256 * MIB:
        raise SystemExit(f"{model_dir} has {free / MIB:.0f} MiB free, the weights file needs {size / MIB:.0f} MiB "
                         f"(and 256 MiB to spare): choose another --model-dir or fewer --layers / --layer-mib")
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            for layer in range(n_layers):
                f.write(memoryview(layer_values(layer, layer_bytes, seed)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def filesystem_type(folder: Path) -> str:
    """What ``stat -f`` says the folder's filesystem is ("unknown" when it cannot tell)."""
    try:
        done = subprocess.run(["stat", "-f", "-c", "%T", str(folder)], capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def probe_read_mode(path: Path) -> tuple[str, str]:
    """The best read mode the file's filesystem allows, and why: ``O_DIRECT`` if an aligned direct read works,
    else ``fadvise_dontneed`` (the file's pages dropped before each pass), else ``page_cache``."""
    why = "os.O_DIRECT does not exist on this platform"
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            why = f"open with O_DIRECT refused: {e.strerror}"
        else:
            try:
                os.preadv(fd, [memoryview(aligned_buffer(ALIGN))], 0)
                return "O_DIRECT", "an aligned O_DIRECT read worked"
            except OSError as e:
                why = f"an O_DIRECT read refused: {e.strerror}"
            finally:
                os.close(fd)
    if hasattr(os, "posix_fadvise"):
        return "fadvise_dontneed", why
    return "page_cache", f"{why}; os.posix_fadvise does not exist either"


class LayerFile:
    """The weights file opened in one read mode; reads a layer into an aligned buffer."""

    def __init__(self, path: Path, n_layers: int, layer_bytes: int, read_mode: str) -> None:
        if read_mode not in READ_MODES:
            raise ValueError(f"unknown read mode {read_mode!r}; one of {', '.join(READ_MODES)}")
        if layer_bytes % ALIGN:
            raise ValueError(f"a layer of {layer_bytes} bytes is not a multiple of {ALIGN}")
        self.path = path
        self.n_layers = n_layers
        self.layer_bytes = layer_bytes
        self.read_mode = read_mode
        flags = os.O_RDONLY | (os.O_DIRECT if read_mode == "O_DIRECT" else 0)
        self.fd = os.open(path, flags)
        if read_mode == "fadvise_dontneed":
            # No readahead: else the kernel reads the next layer in while this one computes, and the serial
            # schedule overlaps too (seen: 0.6 ms "reads" of 8 MiB layers after the first).
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read_into(self, layer: int, buffer: np.ndarray) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} is not in 0..{self.n_layers - 1}")
        view = memoryview(buffer).cast("B")
        if view.nbytes != self.layer_bytes:
            raise ValueError(f"a buffer of {view.nbytes} bytes cannot hold a layer of {self.layer_bytes}")
        offset = layer * self.layer_bytes
        done = 0
        while done < self.layer_bytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)  # releases the GIL while it reads
            if n == 0:
                raise RuntimeError(f"{self.path} ends inside layer {layer}")
            done += n

    def drop_cache(self) -> None:
        """In ``fadvise_dontneed`` mode, drop the file's pages so that the next pass reads from the disk."""
        if self.read_mode == "fadvise_dontneed":
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)


class CpuLayerStream:
    """CPU path: layers read from the weights file into two aligned buffers; numpy computes on them."""

    path = "cpu"

    def __init__(self, file: LayerFile, seed: int) -> None:
        self.file = file
        self.read_mode = file.read_mode
        self.seed = seed
        self.buffers = [aligned_buffer(file.layer_bytes) for _ in range(2)]
        for buffer in self.buffers:
            buffer.fill(0)  # touch every page before timing
        self.matrices = [buffer.view(np.float32).reshape(-1, COLS) for buffer in self.buffers]
        self.activation = activation_values(seed)
        self.plan = ComputePlan(rows=self.matrices[0].shape[0], units=1)  # provisional, until calibrate()

    def load(self, layer: int, slot: int) -> None:
        self.file.read_into(layer, self.buffers[slot])

    def compute(self, layer: int, slot: int) -> float:
        return numpy_checksum(self.matrices[slot], self.activation, self.plan)

    def calibrate(self, ratio: float) -> Calibration:
        layer_rows = self.matrices[0].shape[0]
        sweep = ComputePlan(rows=max(1, layer_rows // UNIT_SLICES), units=UNIT_SLICES)
        numpy_checksum(self.matrices[0], self.activation, sweep)  # untimed: the first matmuls are slow
        copies = []
        units = []
        for sample in range(CALIBRATION_SAMPLES):
            if sample % self.file.n_layers == 0:
                self.file.drop_cache()  # once per sweep of the layers, as a pass does
            start = time.perf_counter()
            self.load(sample % self.file.n_layers, 0)
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            numpy_checksum(self.matrices[0], self.activation, sweep)
            units.append((time.perf_counter() - start) / sweep.units)
        copy_s = statistics.median(copies)
        unit_s = statistics.median(units)
        self.plan = compute_plan(copy_s, unit_s, sweep.rows, ratio)
        return Calibration(copy_s * 1e3, unit_s * 1e3, ratio * copy_s * 1e3, self.plan)

    def run(self, schedule: str) -> Pass:
        self.file.drop_cache()
        if schedule == "serial":
            return stream_serial(self.file.n_layers, self.load, self.compute)
        if schedule == "overlapped":
            return stream_overlapped(self.file.n_layers, self.load, self.compute)
        raise ValueError(f"unknown schedule {schedule!r}")

    def reference_checksum(self, layer: int) -> float:
        return numpy_checksum(layer_values(layer, self.file.layer_bytes, self.seed), self.activation, self.plan)

    def describe(self) -> dict[str, Any]:
        folder = self.file.path.parent
        return {"weights_file": str(self.file.path), "filesystem": filesystem_type(folder),
                "compute": f"numpy {np.__version__} matmul"}

    def close(self) -> None:
        self.file.close()


class CudaLayerStream:
    """GPU path (PyTorch): layers in pinned host memory, copied host -> device on a copy stream into two device
    buffers while a compute stream multiplies; CUDA events order the two streams and time them. Not run on the
    development box (no GPU there)."""

    path = "cuda"
    read_mode = CUDA_READ_MODE

    def __init__(self, n_layers: int, layer_bytes: int, seed: int) -> None:
        import torch  # only the GPU path needs it

        torch.backends.cuda.matmul.allow_tf32 = False
        self.torch = torch
        self.n_layers = n_layers
        self.seed = seed
        self.layer_bytes = layer_bytes
        rows = layer_bytes // 4 // COLS
        self.host = torch.empty((n_layers, rows, COLS), dtype=torch.float32, pin_memory=True)
        for layer in range(n_layers):
            self.host[layer].copy_(torch.from_numpy(layer_values(layer, layer_bytes, seed)))
        self.buffers = [torch.zeros((rows, COLS), dtype=torch.float32, device="cuda") for _ in range(2)]
        self.activation = torch.from_numpy(activation_values(seed)).to("cuda")
        self.copy_stream = torch.cuda.Stream()
        self.compute_stream = torch.cuda.Stream()
        self.plan = ComputePlan(rows=rows, units=1)  # provisional, until calibrate()
        torch.cuda.synchronize()

    def _event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True)

    def _checksum(self, weights: Any, plan: ComputePlan) -> Any:
        """The plan's matmuls on the current stream; their outputs' sum as a float64 device scalar."""
        total = None
        for unit in range(plan.units):
            start, stop = unit_rows(weights.shape[0], plan, unit)
            part = (self.activation @ weights[start:stop].T).sum(dtype=self.torch.float64)
            total = part if total is None else total + part
        return total

    def calibrate(self, ratio: float) -> Calibration:
        layer_rows = self.buffers[0].shape[0]
        sweep = ComputePlan(rows=max(1, layer_rows // UNIT_SLICES), units=UNIT_SLICES)
        copies = []
        units = []
        for sample in range(CALIBRATION_SAMPLES + 1):  # the first, untimed, warms cuBLAS up
            marks = [self._event() for _ in range(3)]
            with self.torch.cuda.stream(self.compute_stream):
                marks[0].record()
                self.buffers[0].copy_(self.host[sample % self.n_layers], non_blocking=True)
                marks[1].record()
                self._checksum(self.buffers[0], sweep)
                marks[2].record()
            marks[2].synchronize()
            if sample:
                copies.append(marks[0].elapsed_time(marks[1]) / 1e3)
                units.append(marks[1].elapsed_time(marks[2]) / 1e3 / sweep.units)
        copy_s = statistics.median(copies)
        unit_s = statistics.median(units)
        self.plan = compute_plan(copy_s, unit_s, sweep.rows, ratio)
        return Calibration(copy_s * 1e3, unit_s * 1e3, ratio * copy_s * 1e3, self.plan)

    def run(self, schedule: str) -> Pass:
        if schedule not in ("serial", "overlapped"):
            raise ValueError(f"unknown schedule {schedule!r}")
        overlapped = schedule == "overlapped"
        n = self.n_layers
        copy_marks = [(self._event(), self._event()) for _ in range(n)]
        compute_marks = [(self._event(), self._event()) for _ in range(n)]
        sums = []
        origin = self._event()
        self.torch.cuda.synchronize()
        origin.record(self.copy_stream)
        for layer in range(n):
            slot = layer % 2 if overlapped else 0
            # The buffer is free once the compute that last read it has ended: layer - 2 with two buffers,
            # layer - 1 with one (which makes the serial schedule's copies wait for the compute before them).
            previous = layer - 2 if overlapped else layer - 1
            with self.torch.cuda.stream(self.copy_stream):
                if previous >= 0:
                    self.copy_stream.wait_event(compute_marks[previous][1])
                copy_marks[layer][0].record()
                self.buffers[slot].copy_(self.host[layer], non_blocking=True)
                copy_marks[layer][1].record()
            with self.torch.cuda.stream(self.compute_stream):
                self.compute_stream.wait_event(copy_marks[layer][1])
                compute_marks[layer][0].record()
                sums.append(self._checksum(self.buffers[slot], self.plan))
                compute_marks[layer][1].record()
        self.torch.cuda.synchronize()
        spans = []
        for layer in range(n):
            slot = layer % 2 if overlapped else 0
            for kind, (begin, end) in (("load", copy_marks[layer]), ("compute", compute_marks[layer])):
                spans.append(Span(kind, layer, slot, origin.elapsed_time(begin) / 1e3, origin.elapsed_time(end) / 1e3))
        wall = origin.elapsed_time(compute_marks[-1][1]) / 1e3
        checksums = [float(v) for v in self.torch.stack(sums).cpu().tolist()]
        return Pass(schedule, wall, checksums, spans)

    def reference_checksum(self, layer: int) -> float:
        weights = self.torch.from_numpy(layer_values(layer, self.layer_bytes, self.seed)).to("cuda")
        return float(self._checksum(weights, self.plan).item())

    def describe(self) -> dict[str, Any]:
        return {"gpu": self.torch.cuda.get_device_name(0), "compute": f"torch {self.torch.__version__} matmul"}

    def close(self) -> None:
        self.torch.cuda.synchronize()


def cuda_unavailable_reason() -> str | None:
    """Why the GPU path cannot run here (None when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (the GPU path is written for PyTorch)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


# -- the measurement ------------------------------------------------------------------------------------------

def open_stream(args: argparse.Namespace) -> tuple[LayerStream, str]:
    """The path to run, and why it was chosen (or why the read mode is what it is)."""
    layer_bytes = args.layer_mib * MIB
    if args.device == "cuda" or (args.device == "auto" and cuda_unavailable_reason() is None):
        return CudaLayerStream(args.layers, layer_bytes, args.seed), "CUDA device present"
    path = weights_file(args.model_dir, args.layers, layer_bytes, args.seed)
    if args.read_mode == "auto":
        mode, why = probe_read_mode(path)
    else:
        mode, why = args.read_mode, "chosen with --read-mode"
    try:
        file = LayerFile(path, args.layers, layer_bytes, mode)
    except OSError as e:
        raise SystemExit(f"cannot open {path} in read mode {mode}: {e.strerror}") from e
    return CpuLayerStream(file, args.seed), why


def pass_summary(p: Pass) -> dict[str, Any]:
    return {"schedule": p.schedule, "wall_ms": p.wall_s * 1e3, "copy_ms": p.mean_ms("load"),
            "compute_ms": p.mean_ms("compute")}


def measure(stream: LayerStream, args: argparse.Namespace) -> dict[str, Any]:
    stream.run("serial")  # untimed, with the provisional plan: buffers, BLAS, disk and (page_cache) the cache warm
    calibration = stream.calibrate(args.compute_ratio)
    reference = stream.reference_checksum(args.layers - 1)
    runs: dict[str, list[Pass]] = {"serial": [], "overlapped": []}
    orders = []
    for repeat in range(args.repeats):
        order = ("serial", "overlapped") if repeat % 2 == 0 else ("overlapped", "serial")
        orders.append(list(order))
        for schedule in order:
            runs[schedule].append(stream.run(schedule))
    first = runs["serial"][0]
    results_equal = all(p.checksums == first.checksums for p in runs["serial"] + runs["overlapped"])
    reference_equal = first.checksums[-1] == reference

    serial_ms = statistics.median(p.wall_s for p in runs["serial"]) * 1e3
    overlapped_ms = statistics.median(p.wall_s for p in runs["overlapped"]) * 1e3
    copy_ms = statistics.median(p.mean_ms("load") for p in runs["serial"])
    compute_ms = statistics.median(p.mean_ms("compute") for p in runs["serial"])
    best_ms = max(copy_ms, compute_ms) * args.layers + min(copy_ms, compute_ms)
    savings = 100 * (serial_ms - overlapped_ms) / serial_ms
    speedup = serial_ms / overlapped_ms
    return {
        "calibration": {**asdict(calibration), "plan": asdict(calibration.plan)},
        "serial_ms": serial_ms,
        "overlapped_ms": overlapped_ms,
        "savings": savings,
        "speedup": speedup,
        "per_layer": {"copy_ms": copy_ms, "compute_ms": compute_ms,
                      "overlapped_copy_ms": statistics.median(p.mean_ms("load") for p in runs["overlapped"]),
                      "overlapped_compute_ms": statistics.median(p.mean_ms("compute") for p in runs["overlapped"]),
                      "compute_over_copy": compute_ms / copy_ms},
        "theoretical_best_ms": best_ms,
        "theoretical_speedup": serial_ms / best_ms,
        "runs": {"serial": [pass_summary(p) for p in runs["serial"]],
                 "overlapped": [pass_summary(p) for p in runs["overlapped"]], "order": orders},
        "results_equal": results_equal,
        "reference_equal": reference_equal,
        "checksums": first.checksums,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    stream, why = open_stream(args)
    try:
        with blas_threads(args.blas_threads if stream.path == "cpu" else 0) as threads:
            figures = measure(stream, args)
        described = stream.describe()
    finally:
        stream.close()
    load_after = os.getloadavg()
    headline = (f"HEADLINE: layer_stream ({args.layers} layers x {args.layer_mib} MiB, {stream.path}, "
                f"{stream.read_mode}): serial={figures['serial_ms']:.2f} ms, "
                f"overlapped={figures['overlapped_ms']:.2f} ms, savings={figures['savings']:.2f}%, "
                f"speedup={figures['speedup']:.3f}x (seed article: {SEED_SPEEDUP}x)")
    if not (figures["results_equal"] and figures["reference_equal"]):
        headline += "; results DIFFER"
    return {
        "benchmark": NAME,
        "quick": args.quick,
        "path": stream.path,
        "read_mode": stream.read_mode,
        "why": why,
        **described,
        "layers": args.layers,
        "layer_mib": args.layer_mib,
        "layer_bytes": args.layer_mib * MIB,
        "repeats": args.repeats,
        "compute_ratio": args.compute_ratio,
        "blas_threads": threads,
        **figures,
        "seed_speedup": SEED_SPEEDUP,
        "load_average": {"before": load_before[0], "after": load_after[0]},
        "machine": machine(),
        "units": ("ms are medians over the repeats; per-layer ms are means over the layers of each pass, then "
                  "medians over the repeats; savings is in % of serial; speedup = serial / overlapped"),
        "headline": headline,
    }


def print_table(r: dict[str, Any]) -> None:
    cal, per = r["calibration"], r["per_layer"]
    where = r.get("weights_file", r.get("gpu", ""))
    fs = f" on {r['filesystem']}" if "filesystem" in r else ""
    print(f"{r['layers']} layers x {r['layer_mib']} MiB, path {r['path']}, read mode {r['read_mode']} ({r['why']}), "
          f"{where}{fs}")
    print(f"compute per layer: {cal['plan']['units']} x a unit of {cal['unit_ms']:.3f} ms ({ACTIVATION_ROWS}x{COLS} "
          f"by {COLS}x{cal['plan']['rows']}), target {r['compute_ratio']} x copy {cal['copy_ms']:.2f} ms; "
          f"BLAS threads {r['blas_threads']}")
    print(f"median of {r['repeats']} repeats; load average {r['load_average']['before']:.2f} -> "
          f"{r['load_average']['after']:.2f}")
    print(f"{'schedule':<18} {'total ms':>10} {'copy ms/layer':>14} {'compute ms/layer':>17}")
    print(f"{'serial':<18} {r['serial_ms']:>10.2f} {per['copy_ms']:>14.2f} {per['compute_ms']:>17.2f}")
    print(f"{'overlapped':<18} {r['overlapped_ms']:>10.2f} {per['overlapped_copy_ms']:>14.2f} "
          f"{per['overlapped_compute_ms']:>17.2f}")
    print(f"{'theoretical best':<18} {r['theoretical_best_ms']:>10.2f}   max(copy, compute) x {r['layers']} + min "
          f"(speedup {r['theoretical_speedup']:.3f}x)")
    print(f"checksums: overlapped == serial in every pass: {'yes' if r['results_equal'] else 'NO'}; "
          f"last layer == weights made in memory: {'yes' if r['reference_equal'] else 'NO'}")


def positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 layers x 8 MiB, 1 repeat")
    p.add_argument("--layers", type=int, default=None, help="layers (default 24; quick 6)")
    p.add_argument("--layer-mib", type=int, default=None, help="MiB of weights per layer (default 64; quick 8)")
    p.add_argument("--repeats", type=int, default=None, help="passes of each schedule (default 3; quick 1)")
    p.add_argument("--compute-ratio", type=positive_float, default=1.0,
                   help="a layer's compute time over its copy time, the target of the calibration (default 1.0)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: pinned host -> device copies (needs PyTorch with CUDA); cpu: reads from a file")
    p.add_argument("--read-mode", choices=("auto", *READ_MODES), default="auto",
                   help="CPU path: how the file is read (auto: O_DIRECT if the filesystem allows it, else "
                        "fadvise_dontneed)")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="CPU path: numpy's OpenBLAS threads during the run (default 1: one core computes while the "
                        "loader reads; 0: the library's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"layers": 24, "layer_mib": 64, "repeats": 3},
                  quick={"layers": 6, "layer_mib": 8, "repeats": 1})
    if args.layers < 1 or args.layer_mib < 1 or args.repeats < 1:
        p.error("--layers, --layer-mib and --repeats must be >= 1")
    if args.blas_threads < 0:
        p.error("--blas-threads must be >= 0 (0: the library's default)")
    if args.device == "cuda" and (why := cuda_unavailable_reason()) is not None:
        p.error(f"--device cuda: {why}")
    if args.device == "cuda" and args.read_mode != "auto":
        p.error("--read-mode is for the CPU path; the CUDA path copies from pinned host memory")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["results_equal"] and result["reference_equal"])


if __name__ == "__main__":
    sys.exit(main())
