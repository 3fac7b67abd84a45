"""benchmarks/layer_stream.py: the two schedules (with fake loads and computes), the exact compute, the weights
file and its reads, and the --quick run end to end on the CPU path."""

from __future__ import annotations

import ctypes
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import layer_stream
from benchmarks.layer_stream import (
    MIB,
    READ_MODES,
    ComputePlan,
    LayerFile,
    Pass,
    Span,
    aligned_buffer,
    blas_threads,
    compute_plan,
    layer_values,
    numpy_checksum,
    stream_overlapped,
    stream_serial,
    unit_rows,
)

STEP_S = 0.05


class FakeLayers:
    """Loads and computes that sleep (releasing the GIL, as a read and a matmul do); a compute's checksum is what
    its buffer holds, so a compute on the wrong or an unfinished buffer gives another result."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.buffers: dict[int, int] = {}
        self.fail_at = fail_at

    def load(self, layer: int, slot: int) -> None:
        if layer == self.fail_at:
            raise OSError(f"disk gone at layer {layer}")
        self.buffers[slot] = -1  # mid-copy
        time.sleep(STEP_S)
        self.buffers[slot] = layer

    def compute(self, layer: int, slot: int) -> float:
        held = self.buffers[slot]
        time.sleep(STEP_S)
        return float(held * 100 + layer)


def spans_of(p: Pass, kind: str) -> dict[int, Span]:
    found = {s.layer: s for s in p.spans if s.kind == kind}
    assert len(found) == len([s for s in p.spans if s.kind == kind])  # one span per layer
    return found


# -- the schedules --------------------------------------------------------------------------------------------

def test_serial_never_overlaps_and_runs_load_then_compute_per_layer() -> None:
    n = 4
    layers = FakeLayers()
    p = stream_serial(n, layers.load, layers.compute)
    assert p.schedule == "serial"
    assert [(s.kind, s.layer) for s in p.spans] == [(k, i) for i in range(n) for k in ("load", "compute")]
    for before, after in zip(p.spans, p.spans[1:], strict=False):
        assert after.start >= before.end
    assert {s.slot for s in p.spans} == {0}
    assert p.checksums == [float(i * 100 + i) for i in range(n)]
    assert p.wall_s >= p.spans[-1].end - p.spans[0].start


def test_overlapped_loads_the_next_layer_while_this_one_computes() -> None:
    n = 4
    layers = FakeLayers()
    p = stream_overlapped(n, layers.load, layers.compute)
    assert p.schedule == "overlapped"
    loads = spans_of(p, "load")
    computes = spans_of(p, "compute")
    assert sorted(loads) == sorted(computes) == list(range(n))
    for i in range(n):
        assert computes[i].start >= loads[i].end  # a compute waits for its layer's load
        assert computes[i].slot == loads[i].slot == i % 2
    for i in range(n - 1):
        assert loads[i + 1].start < computes[i].end  # the next load starts before this compute ends
        assert loads[i + 1].slot != computes[i].slot  # into the other buffer
    for i in range(1, n - 1):
        assert loads[i + 1].start >= computes[i - 1].end  # once the last compute on that buffer has ended
    # Same results as the serial schedule: every compute saw its own, complete layer.
    serial = stream_serial(n, layers.load, layers.compute)
    assert p.checksums == serial.checksums == [float(i * 100 + i) for i in range(n)]


def test_a_compute_on_the_wrong_buffer_changes_the_result() -> None:
    """The fake checksum can tell: computing on the buffer being loaded gives other numbers."""
    layers = FakeLayers()

    def wrong_slot(layer: int, slot: int) -> float:
        return layers.compute(layer, 1 - slot)

    good = stream_overlapped(4, layers.load, layers.compute)
    bad = stream_overlapped(4, layers.load, wrong_slot)
    assert bad.checksums != good.checksums


def test_a_load_error_is_raised_by_the_pass() -> None:
    layers = FakeLayers(fail_at=2)
    with pytest.raises(OSError, match="disk gone at layer 2"):
        stream_overlapped(4, layers.load, layers.compute)
    layers = FakeLayers(fail_at=1)
    with pytest.raises(OSError, match="disk gone at layer 1"):
        stream_serial(3, layers.load, layers.compute)


@pytest.mark.parametrize("stream", [stream_serial, stream_overlapped])
def test_a_pass_needs_a_layer(stream: Any) -> None:
    layers = FakeLayers()
    with pytest.raises(ValueError, match="at least one layer"):
        stream(0, layers.load, layers.compute)


def test_one_layer_is_one_load_and_one_compute() -> None:
    layers = FakeLayers()
    p = stream_overlapped(1, layers.load, layers.compute)
    assert [(s.kind, s.layer, s.slot) for s in p.spans] == [("load", 0, 0), ("compute", 0, 0)]
    assert p.checksums == [0.0]


# -- the compute ----------------------------------------------------------------------------------------------

def test_compute_plan_repeats_the_unit_to_the_target() -> None:
    assert compute_plan(copy_s=0.010, unit_s=0.001, rows=256, ratio=1.0) == ComputePlan(rows=256, units=10)
    assert compute_plan(copy_s=0.010, unit_s=0.001, rows=256, ratio=2.5) == ComputePlan(rows=256, units=25)
    assert compute_plan(copy_s=0.001, unit_s=0.010, rows=256, ratio=1.0) == ComputePlan(rows=256, units=1)
    for bad in ({"copy_s": 0.0}, {"unit_s": -1.0}, {"rows": 0}, {"ratio": 0.0}):
        kwargs: dict[str, Any] = {"copy_s": 0.01, "unit_s": 0.001, "rows": 256, "ratio": 1.0, **bad}
        with pytest.raises(ValueError, match="cannot plan"):
            compute_plan(**kwargs)


def test_units_take_slices_from_the_end_of_the_layer_round_and_round() -> None:
    plan = ComputePlan(rows=256, units=6)
    assert [unit_rows(1024, plan, u) for u in range(6)] == [(768, 1024), (512, 768), (256, 512), (0, 256),
                                                              (768, 1024), (512, 768)]
    assert unit_rows(1000, ComputePlan(rows=300, units=1), 0) == (600, 900)  # whole slices only
    with pytest.raises(ValueError, match="does not fit"):
        unit_rows(100, ComputePlan(rows=101, units=1), 0)


def test_the_checksum_is_exact() -> None:
    """Small integers: the float32 matmul equals the same sum done in integers, whatever order BLAS adds in."""
    weights = layer_values(3, MIB, seed=5)
    activation = layer_stream.activation_values(5)
    plan = ComputePlan(rows=64, units=5)
    expected = 0
    for u in range(plan.units):
        start, stop = unit_rows(weights.shape[0], plan, u)
        expected += int((activation.astype(np.int64) @ weights[start:stop].astype(np.int64).T).sum())
    assert numpy_checksum(weights, activation, plan) == float(expected)
    assert numpy_checksum(layer_values(4, MIB, seed=5), activation, plan) != float(expected)  # layers differ


def test_blas_threads_are_set_inside_the_block_and_restored() -> None:
    libraries = layer_stream.loaded_openblas()
    if not libraries:
        pytest.skip("numpy is not on OpenBLAS here")
    lib = ctypes.CDLL(libraries[0])
    getter = next((getattr(lib, g) for s, g in layer_stream.OPENBLAS_THREAD_CALLS if hasattr(lib, g)), None)
    assert getter is not None
    before = int(getter())
    with blas_threads(1) as what:
        assert int(getter()) == 1
        assert what.startswith("1 (OpenBLAS")
    assert int(getter()) == before
    with blas_threads(0) as what:
        assert int(getter()) == before and what == "the library's default"


# -- the weights file and its reads ---------------------------------------------------------------------------

def test_aligned_buffer() -> None:
    for size in (4096, 3 * MIB):
        buffer = aligned_buffer(size)
        assert buffer.ctypes.data % layer_stream.ALIGN == 0 and buffer.nbytes == size


def test_weights_file_is_written_once_and_read_back_in_every_mode(tmp_path: Path) -> None:
    path = layer_stream.weights_file(tmp_path, 3, MIB, seed=2)
    assert path.name == "layers-3x1MiB-f32-s2.bin" and path.stat().st_size == 3 * MIB
    mtime = path.stat().st_mtime_ns
    assert layer_stream.weights_file(tmp_path, 3, MIB, seed=2) == path and path.stat().st_mtime_ns == mtime
    assert list(tmp_path.iterdir()) == [path]  # no partial file left

    probed, why = layer_stream.probe_read_mode(path)
    assert probed in READ_MODES and why
    modes = {probed, "fadvise_dontneed", "page_cache"}
    for mode in modes:
        file = LayerFile(path, 3, MIB, mode)
        try:
            buffer = aligned_buffer(MIB)
            for layer in (2, 0, 1):
                file.drop_cache()
                file.read_into(layer, buffer)
                assert np.array_equal(buffer.view(np.float32).reshape(-1, layer_stream.COLS),
                                      layer_values(layer, MIB, seed=2)), (mode, layer)
            with pytest.raises(IndexError):
                file.read_into(3, buffer)
            with pytest.raises(ValueError, match="cannot hold"):
                file.read_into(0, aligned_buffer(2 * MIB))
        finally:
            file.close()


def test_a_short_file_and_a_bad_mode_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * (MIB + 4096))
    file = LayerFile(path, 2, MIB, "page_cache")
    try:
        with pytest.raises(RuntimeError, match="ends inside layer 1"):
            file.read_into(1, aligned_buffer(MIB))
    finally:
        file.close()
    with pytest.raises(ValueError, match="unknown read mode"):
        LayerFile(path, 2, MIB, "mmap")


# -- the script ---------------------------------------------------------------------------------------------

def run_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "layer_stream.json"
    rc = layer_stream.main(["--quick", "--model-dir", str(tmp_path / "models"), "--out", str(out), *extra])
    printed = capsys.readouterr().out
    return rc, json.loads(out.read_text()), printed


def headline_of(printed: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith("HEADLINE:")]
    assert len(lines) == 1, printed
    return lines[0]


def test_quick_run_on_the_cpu_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, r, printed = run_quick(tmp_path, capsys, "--device", "cpu")
    assert rc == 0
    assert r["benchmark"] == "layer_stream" and r["quick"] is True
    assert r["path"] == "cpu" and r["read_mode"] in READ_MODES
    assert (r["layers"], r["layer_mib"], r["repeats"]) == (6, 8, 1)
    assert Path(r["weights_file"]).stat().st_size == 6 * 8 * MIB and r["filesystem"]
    assert r["results_equal"] is True and r["reference_equal"] is True
    assert len(r["checksums"]) == 6 and len(set(r["checksums"])) == 6  # every layer computed on its own weights

    serial, overlapped = r["serial_ms"], r["overlapped_ms"]
    assert serial > 0 and overlapped > 0
    assert r["savings"] == pytest.approx(100 * (serial - overlapped) / serial)
    assert r["speedup"] == pytest.approx(serial / overlapped)
    per = r["per_layer"]
    copy_ms, compute_ms = per["copy_ms"], per["compute_ms"]
    assert copy_ms > 0 and compute_ms > 0
    assert r["theoretical_best_ms"] == pytest.approx(max(copy_ms, compute_ms) * 6 + min(copy_ms, compute_ms))
    # One repeat: a serial pass lasts at least its loads and computes one after the other; an overlapped one at
    # least its computes (one thread) and at least its loads (one loader).
    assert serial >= 6 * (copy_ms + compute_ms) - 1e-6
    assert overlapped >= 6 * max(per["overlapped_copy_ms"], per["overlapped_compute_ms"]) - 1e-6
    cal = r["calibration"]
    assert cal["plan"]["units"] >= 1 and cal["copy_ms"] > 0 and cal["unit_ms"] > 0
    assert cal["target_compute_ms"] == pytest.approx(r["compute_ratio"] * cal["copy_ms"])
    assert r["runs"]["order"] == [["serial", "overlapped"]]
    assert len(r["runs"]["serial"]) == len(r["runs"]["overlapped"]) == 1

    headline = headline_of(printed)
    assert headline == r["headline"]
    assert re.fullmatch(r"HEADLINE: layer_stream \(6 layers x 8 MiB, cpu, (O_DIRECT|fadvise_dontneed|page_cache)\): "
                        r"serial=[\d.]+ ms, overlapped=[\d.]+ ms, savings=-?[\d.]+%, speedup=[\d.]+x "
                        r"\(seed article: 1\.285x\)", headline)
    assert f"read mode {r['read_mode']}" in printed


def test_quick_run_with_fadvise_and_repeats_alternates_the_order(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, r, _ = run_quick(tmp_path, capsys, "--read-mode", "fadvise_dontneed", "--repeats", "2", "--layers", "3",
                         "--compute-ratio", "0.5")
    assert rc == 0 and r["read_mode"] == "fadvise_dontneed" and r["why"] == "chosen with --read-mode"
    assert r["results_equal"] is True and r["reference_equal"] is True
    assert r["runs"]["order"] == [["serial", "overlapped"], ["overlapped", "serial"]]
    assert r["serial_ms"] == pytest.approx(np.median([run["wall_ms"] for run in r["runs"]["serial"]]))


def test_the_check_fails_when_an_overlapped_load_brings_the_wrong_layer(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    original = layer_stream.stream_overlapped

    def misloading(n_layers: int, load: Any, compute: Any) -> Pass:
        def stale(layer: int, slot: int) -> None:
            load(layer - 1 if layer == n_layers - 1 else layer, slot)

        return original(n_layers, stale, compute)

    monkeypatch.setattr(layer_stream, "stream_overlapped", misloading)
    rc, r, printed = run_quick(tmp_path, capsys)
    assert rc == 1
    assert r["results_equal"] is False and r["reference_equal"] is True
    assert headline_of(printed).endswith("; results DIFFER")


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "must be >= 1"),
    (["--layer-mib", "0"], "must be >= 1"),
    (["--repeats", "0"], "must be >= 1"),
    (["--compute-ratio", "0"], "positive number"),
    (["--compute-ratio", "nan"], "positive number"),
    (["--blas-threads", "-1"], "--blas-threads"),
])
def test_bad_options_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        layer_stream.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_asked_for_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    why = layer_stream.cuda_unavailable_reason()
    if why is None:
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        layer_stream.parse_args(["--device", "cuda"])
    assert why in capsys.readouterr().err
