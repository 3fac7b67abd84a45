"""Where a model's layers run: the ledger estimate split by the offloaded layers (the numbers for all layers are the
old ones), the placement decision (a host-RAM device or a CPU build runs on the CPU, loudly when GPU layers were
asked for; ``auto`` takes as many layers as the ledger's free bytes hold), ``n_gpu_layers: auto`` in the config, the
build check that ``scripts/setup.sh`` runs after a CUDA build, and, on this machine's build, a real appliance asked
for GPU layers on host RAM: its warnings, its STATUS record and the admin page's CPU/GPU column."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from harness import running

from appliance.client import lines as lineclient
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.daemon import offload
from appliance.daemon.offload import Offload, auto_layers, place, startup_notes
from appliance.engine import gguf_meta, gpubuild
from appliance.engine.gguf_meta import COMPUTE_FLOOR_BYTES, ModelShape, estimate, read_model_shape
from appliance.errors import ApplianceError
from appliance.protocol import lines

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
GIB = 1024 * MIB
UP_S = 90


@pytest.fixture(scope="module")
def shape(tiny_model: Path) -> ModelShape:
    """The 4-block fixture model's shape: 5 layers as llama.cpp counts them (4 blocks and the output layer)."""
    return read_model_shape(tiny_model)


# -- the estimate, split by the offloaded layers -----------------------------------------------------------------------

def test_every_layer_offloaded_keeps_the_old_numbers(shape: ModelShape) -> None:
    everything = estimate(shape, 2048)
    assert everything.weights == shape.weight_bytes and everything.host == 0
    assert estimate(shape, 2048, "f16", shape.offload_layers) == everything
    assert estimate(shape, 2048, "f16", -1) == everything
    assert estimate(shape, 2048, "f16", 10_000) == everything
    assert everything.total == everything.weights + everything.kv + everything.compute


def test_a_split_counts_the_last_blocks_and_their_kv_on_the_device(shape: ModelShape) -> None:
    assert shape.layers == 4 and shape.offload_layers == 5 and len(set(shape.block_bytes)) == 1
    block = shape.block_bytes[0]
    everything = estimate(shape, 2048)
    kv_per_layer = everything.kv // shape.layers
    for gpu_layers in range(shape.layers + 1):  # 0..4 blocks; the output layer stays on the CPU
        split = estimate(shape, 2048, "f16", gpu_layers)
        assert split.weights == gpu_layers * block
        assert split.host_weights == shape.weight_bytes - gpu_layers * block
        assert split.kv == gpu_layers * kv_per_layer and split.host_kv == (shape.layers - gpu_layers) * kv_per_layer
        assert split.weights + split.host_weights == shape.weight_bytes and split.kv + split.host_kv == everything.kv
        assert split.compute == COMPUTE_FLOOR_BYTES  # 5 % of a tiny model is under the floor
        assert split.total == split.weights + split.kv + split.compute
    nothing = estimate(shape, 2048, "f16", 0)
    assert nothing.total == COMPUTE_FLOOR_BYTES and nothing.host == shape.weight_bytes + everything.kv
    blocks_only = estimate(shape, 2048, "f16", shape.layers)
    assert blocks_only.host_weights == shape.weight_bytes - sum(shape.block_bytes) > 0  # embeddings and output


def test_llama_cpp_offloads_the_last_blocks_first() -> None:
    shape = ModelShape("llama", 3, 64, 1, 1, 64, 64, 512, weight_bytes=1000, file_bytes=1000,
                       block_bytes=(100, 200, 300))
    assert [estimate(shape, 256, "f16", n).weights for n in range(5)] == [0, 300, 500, 600, 1000]


def test_a_split_needs_each_blocks_bytes() -> None:
    shape = ModelShape("llama", 3, 64, 1, 1, 64, 64, 512, weight_bytes=1000, file_bytes=1000)
    assert estimate(shape, 256).weights == 1000  # all layers: no split needed
    with pytest.raises(ValueError, match="each block's bytes"):
        estimate(shape, 256, "f16", 1)


def test_the_device_part_grows_with_each_layer(shape: ModelShape) -> None:
    figures = gguf_meta.device_bytes_by_layers(shape, 2048)
    assert len(figures) == shape.offload_layers + 1
    assert list(figures) == sorted(figures) and figures[0] < figures[-1] == estimate(shape, 2048).total
    big = ModelShape("llama", 32, 4096, 32, 8, 128, 128, 8192, weight_bytes=17 * GIB, file_bytes=17 * GIB,
                     block_bytes=(GIB // 2,) * 32)  # 1 GiB of embeddings and output
    figures = gguf_meta.device_bytes_by_layers(big, 8192)
    assert all(a < b for a, b in zip(figures, figures[1:], strict=False))
    assert figures[16] == GIB // 2 * 16 + GIB // 2 + (GIB // 2 * 16 + GIB // 2 + 19) // 20  # 16 blocks, half the KV


# -- auto: as many layers as the ledger's free bytes hold --------------------------------------------------------------

@pytest.mark.parametrize(("free", "chosen"), [(0, 0), (99, 0), (100, 0), (149, 0), (150, 1), (260, 2), (400, 4),
                                              (10**12, 4)])
def test_auto_takes_the_most_layers_that_fit(free: int, chosen: int) -> None:
    assert auto_layers(free, [100, 150, 200, 300, 400]) == chosen


def test_auto_layers_follow_the_free_bytes(shape: ModelShape) -> None:
    figures = gguf_meta.device_bytes_by_layers(shape, 2048)
    for layers, needed in enumerate(figures):
        placed = place(shape, requested=None, n_ctx=2048, cache_type="f16", device_kind="nvml", build_offloads=True,
                       free_bytes=needed)
        assert placed.gpu_layers == layers and placed.layers == 5 and not placed.ledger_all
        assert placed.host_bytes == estimate(shape, 2048, "f16", layers).host
        assert (placed.reason == "") == (layers == 5)
        if layers < 5:
            assert placed.reason == f"auto: {layers} of 5 layers fit in the ledger's {needed} free bytes"
            assert place(shape, requested=None, n_ctx=2048, cache_type="f16", device_kind="nvml",
                         build_offloads=True, free_bytes=figures[layers + 1] - 1).gpu_layers == layers


# -- the placement decision -------------------------------------------------------------------------------------------

def placed(shape: ModelShape | None, requested: int | None, kind: str, build: bool) -> Offload:
    return place(shape, requested=requested, n_ctx=2048, cache_type="f16", device_kind=kind, build_offloads=build,
                 free_bytes=100 * GIB)


def test_why_no_layer_can_be_offloaded() -> None:
    assert offload.cpu_only_reason("host", True) == "the memory device is host RAM, not a GPU"
    assert offload.cpu_only_reason("fake", True) == "the memory device is a fake one (tests), with no GPU behind it"
    assert offload.cpu_only_reason("host", False) == "the memory device is host RAM, not a GPU"  # the device first
    assert offload.cpu_only_reason("nvml", False) == (
        "this llama.cpp build cannot offload to a GPU (it was built without GPU support: APPLIANCE_GPU=cuda "
        "scripts/setup.sh rebuilds it with CUDA)")
    assert offload.cpu_only_reason("nvml", True) is None


@pytest.mark.parametrize("kind", ["host", "fake"])
@pytest.mark.parametrize("build", [True, False])
def test_a_device_without_a_gpu_runs_every_layer_on_the_cpu_and_its_ledger_holds_everything(
        shape: ModelShape, kind: str, build: bool) -> None:
    for requested in (-1, 3, None, 0):
        where = placed(shape, requested, kind, build)
        assert (where.gpu_layers, where.split, where.processor) == (0, "0/5", "CPU")
        assert where.ledger_all and where.ledger_layers is None and where.host_bytes == 0
        assert where.cpu_fallback == (requested not in (0, None))
        assert (where.reason == offload.cpu_only_reason(kind, build)) == (requested != 0)
        assert (where.reason == "") == (requested == 0)


def test_a_cpu_build_runs_on_the_cpu_and_counts_the_rest_as_host_ram(shape: ModelShape) -> None:
    where = placed(shape, -1, "nvml", False)
    assert (where.gpu_layers, where.processor, where.ledger_all, where.ledger_layers) == (0, "CPU", False, 0)
    assert where.host_bytes == estimate(shape, 2048).weights + estimate(shape, 2048).kv
    assert where.cpu_fallback and "built without GPU support" in where.reason and offload.REBUILD in where.reason
    assert offload.fallback_warning("m", where) == (
        f"model m: n_gpu_layers -1 asks for GPU layers, but {where.reason}: it runs on the CPU (0/5 layers on the GPU)")
    assert not placed(shape, 0, "nvml", False).cpu_fallback and placed(shape, 0, "nvml", False).reason == ""
    auto = placed(shape, None, "nvml", False)
    assert auto.gpu_layers == 0 and not auto.cpu_fallback and "built without GPU support" in auto.reason


def test_a_gpu_build_on_a_gpu_offloads_what_was_asked(shape: ModelShape) -> None:
    for requested, gpu_layers, processor in ((-1, 5, "GPU"), (5, 5, "GPU"), (99, 5, "GPU"), (2, 2, "CPU/GPU"),
                                             (0, 0, "CPU")):
        where = placed(shape, requested, "nvml", True)
        assert (where.gpu_layers, where.processor, where.reason, where.cpu_fallback) == (gpu_layers, processor, "",
                                                                                         False)
        assert where.ledger_layers == gpu_layers and where.host_bytes == estimate(shape, 2048, "f16", gpu_layers).host
    assert placed(shape, None, "nvml", True).gpu_layers == 5  # 100 GiB free


def test_an_operators_figure_with_a_layer_count_needs_no_file() -> None:
    where = placed(None, -1, "nvml", True)
    assert (where.gpu_layers, where.layers, where.split, where.processor, where.host_bytes) == (-1, None, "all", "GPU",
                                                                                             None)
    assert placed(None, 7, "nvml", True).split == "7" and placed(None, 7, "nvml", True).processor == "CPU/GPU"
    assert placed(None, -1, "host", True).split == "0" and placed(None, -1, "host", True).cpu_fallback
    with pytest.raises(ValueError, match="auto needs the model's shape"):
        placed(None, None, "nvml", True)


def test_the_record_that_status_and_the_admin_page_show(shape: ModelShape) -> None:
    assert offload.record(None) == {"gpu_layers": None, "processor": None, "host_bytes": None, "offload_note": None}
    assert offload.record(placed(shape, 2, "nvml", True)) == {
        "gpu_layers": "2/5", "processor": "CPU/GPU", "host_bytes": estimate(shape, 2048, "f16", 2).host,
        "offload_note": None}
    assert offload.record(placed(shape, -1, "host", True))["offload_note"] == "the memory device is host RAM, not a GPU"
    assert offload.loaded_note(placed(shape, 2, "nvml", True)) == "2/5 layers on the GPU"
    assert offload.loaded_note(placed(shape, -1, "fake", True)) == (
        "0/5 layers on the GPU (the memory device is a fake one (tests), with no GPU behind it)")


def test_start_up_notes_warn_for_asked_for_layers_that_cannot_be() -> None:
    models = [("none", 0), ("all", -1), ("some", 12), ("auto", None)]
    assert startup_notes(models, "nvml", True) == []
    notes = startup_notes(models, "host", True)
    assert notes == [
        ("warning", "model all: n_gpu_layers -1 asks for GPU layers, but the memory device is host RAM, not a GPU: it "
                    "runs on the CPU"),
        ("warning", "model some: n_gpu_layers 12 asks for GPU layers, but the memory device is host RAM, not a GPU: "
                    "it runs on the CPU"),
        ("info", "model auto: n_gpu_layers auto runs on the CPU: the memory device is host RAM, not a GPU")]
    assert [level for level, _ in startup_notes(models, "nvml", False)] == ["warning", "warning", "info"]
    assert all("built without GPU support" in line for _, line in startup_notes(models, "nvml", False))


# -- the config ------------------------------------------------------------------------------------------------------

def test_n_gpu_layers_takes_auto_or_a_count_of_at_least_minus_one() -> None:
    def model(value: str) -> int | None:
        text = f"models:\n  - {{name: m, path: /m.gguf, n_gpu_layers: {value}}}\n"
        return parse_config(text).models[0].n_gpu_layers

    assert (model("auto"), model("-1"), model("0"), model("33")) == (None, -1, 0, 33)
    assert parse_config("models:\n  - {name: m, path: /m.gguf}\n").models[0].n_gpu_layers == 0
    for value, fragment in (("-2", "≥ -1"), ("all", "must be `auto` or an integer"), ("1.5", "`auto` or an integer"),
                            ("true", "`auto` or an integer")):
        with pytest.raises(ConfigInvalid) as info:
            model(value)
        (problem,) = info.value.problems
        assert problem.path == "models[0].n_gpu_layers" and problem.line == 2 and fragment in problem.message


# -- the build check -------------------------------------------------------------------------------------------------

def test_the_build_verdict() -> None:
    assert gpubuild.verdict(offloads=True, installed="0.3.36", pinned="0.3.36") == (
        True, "llama-cpp-python 0.3.36 offloads to a GPU: llama_supports_gpu_offload() is true")
    ok, line = gpubuild.verdict(offloads=False, installed="0.3.36", pinned=None)
    assert not ok and line.startswith("llama-cpp-python 0.3.36 cannot offload to a GPU: llama_supports_gpu_offload()")
    assert gpubuild.verdict(offloads=True, installed="0.3.35", pinned="0.3.36") == (
        False, "llama-cpp-python 0.3.35 is installed, not the pinned 0.3.36")


def test_the_build_check_says_in_one_line_what_this_build_does() -> None:
    command = [sys.executable, "-m", "appliance.engine.gpubuild", "--version", gpubuild.installed_version()]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    offloads = gpubuild.offload_supported()
    assert result.returncode == (0 if offloads else 1)
    said = (result.stdout if offloads else result.stderr).splitlines()
    assert len(said) == 1 and said[0] == gpubuild.verdict(offloads=offloads, installed=gpubuild.installed_version(),
                                                          pinned=None)[1]
    quiet = subprocess.run([sys.executable, "-m", "appliance.engine.gpubuild", "--quiet", "--version", "0.0.1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (1, "", "")


def setup_dry_run(**environment: str) -> subprocess.CompletedProcess[str]:
    """``scripts/setup.sh`` printing what it would run (``APPLIANCE_SETUP_DRY_RUN=1``), with ``environment``."""
    env = {name: value for name, value in os.environ.items() if name not in ("APPLIANCE_GPU", "CMAKE_ARGS")}
    env.update(APPLIANCE_SETUP_DRY_RUN="1", **environment)
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_setup_with_appliance_gpu_cuda_rebuilds_llama_cpp_python_with_cuda() -> None:
    pinned = gpubuild.installed_version()
    result = setup_dry_run(APPLIANCE_GPU="cuda", CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native")
    assert result.returncode == 0, result.stderr
    if gpubuild.offload_supported():  # a CUDA build is installed already: kept
        assert f"setup: llama-cpp-python {pinned} already offloads to a GPU: kept" in result.stderr
        return
    cores = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    assert (r"setup: would run: env CMAKE_ARGS=-DGGML_CUDA=on\ -DCMAKE_CUDA_ARCHITECTURES=native FORCE_CMAKE=1 "
            f"CMAKE_BUILD_PARALLEL_LEVEL={cores} .venv/bin/python -m pip install --progress-bar off "
            f"--no-cache-dir --force-reinstall --no-deps llama-cpp-python=={pinned}") in result.stderr
    assert f"setup: would run: .venv/bin/python -m appliance.engine.gpubuild --version {pinned}" in result.stderr


def test_setup_without_appliance_gpu_builds_nothing_with_cuda_and_refuses_another_gpu() -> None:
    plain = setup_dry_run()
    assert plain.returncode == 0 and "CUDA" not in plain.stderr and "GGML" not in plain.stderr
    other = setup_dry_run(APPLIANCE_GPU="rocm")
    assert other.returncode == 2
    assert other.stderr.splitlines()[-1] == "setup: APPLIANCE_GPU must be cuda or unset (got 'rocm')"
    assert "would run: env CMAKE_ARGS" not in other.stderr


# -- a real appliance on this machine's build, asked for GPU layers on host RAM ----------------------------------------

@pytest.fixture
def state() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="ao-"))  # short: AF_UNIX paths are limited to 108 bytes
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def model_records(reply: str) -> dict[str, dict[str, str]]:
    body = lines.parse_reply(reply).body or ""
    records = [lines.parse_fields(line.removeprefix("model ")) for line in body.splitlines()
               if line.startswith("model ")]
    return {record["name"]: record for record in records}


def test_gpu_layers_on_host_ram_run_on_the_cpu_loudly(state: Path, tiny_model: Path) -> None:
    config = state / "appliance.yaml"
    config.write_text(yaml.safe_dump({
        "data_dir": str(state), "device": "host", "http": {"port": 0}, "resync_interval_s": 0,
        "engine": {"adaptive": False},  # the ledger's figure is the full n_ctx's
        "models": [{"name": "all", "path": str(tiny_model), "n_gpu_layers": -1},
                   {"name": "auto", "path": str(tiny_model), "n_gpu_layers": "auto"},
                   {"name": "none", "path": str(tiny_model)}]}))
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + UP_S
        while not (state / "registry.json").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the daemon did not come up"
            time.sleep(0.1)
        socket_path = state / "appliance.sock"
        assert lineclient.request(socket_path, "REGISTER a all", 60).startswith("OK ")
        assert lineclient.request(socket_path, "REGISTER b none", 60).startswith("OK ")
        records = model_records(lineclient.request(socket_path, "STATUS", 30))
        assert lineclient.request(socket_path, "UNREGISTER a", 60).startswith("OK ")  # its last agent: unloaded
        assert lineclient.request(socket_path, "REGISTER c all", 60).startswith("OK ")  # loaded again
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    everything = estimate(read_model_shape(tiny_model), 2048).total
    for name in ("all", "none"):  # on host RAM the ledger holds every byte, whatever n_gpu_layers says
        assert records[name]["estimate_bytes"] == str(everything)
        assert (records[name]["gpu_layers"], records[name]["processor"], records[name]["host_bytes"]) == ("0/5", "CPU",
                                                                                                          "0")
    assert records["all"]["offload_note"] == "the memory device is host RAM, not a GPU"
    assert records["none"]["offload_note"] == "none"  # as asked: no note
    said = output.splitlines()
    start_up = ("model all: n_gpu_layers -1 asks for GPU layers, but the memory device is host RAM, not a GPU: it runs "
                "on the CPU")
    assert [line for line in said if line.endswith(start_up)] and "WARNING" in next(
        line for line in said if line.endswith(start_up))
    assert any(line.endswith("model auto: n_gpu_layers auto runs on the CPU: the memory device is host RAM, not a GPU")
               for line in said)
    assert not any("model none: n_gpu_layers" in line for line in said)
    at_load = start_up + " (0/5 layers on the GPU)"
    assert len([line for line in said if line.endswith(at_load) and "WARNING" in line]) == 2, output  # each load
    assert any(f"model all loaded: estimate {everything} bytes" in line
               and line.endswith("0/5 layers on the GPU (the memory device is host RAM, not a GPU)") for line in said)
    assert any(f"model none loaded: estimate {everything} bytes" in line and line.endswith(", 0/5 layers on the GPU")
               for line in said)


def test_the_admin_page_shows_where_each_models_layers_run(tiny_model: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    models = {"auto": {"path": str(tiny_model), "n_gpu_layers": "auto"}, "idle": {"path": str(tiny_model)}}
    with caplog.at_level(logging.INFO, logger="appliance"), running(models, model_dirs=[tiny_model.parent]) as app:
        app.call(app.daemon.register("a", "auto"))
        html = httpx.get(app.appliance.http_url + "/admin/_dashboard", timeout=30).text
        record = next(m for m in app.daemon.snapshot()["models"] if m["name"] == "auto")
    assert "<th>CPU/GPU</th>" in html
    row = html[html.index('<tr data-model="auto">'):]
    row = row[:row.index("</tr>")]
    note = "the memory device is a fake one (tests), with no GPU behind it"
    assert f'<td class="processor" title="{note}">CPU <small>0/5 layers on the GPU</small></td>' in row
    idle = html[html.index('<tr data-model="idle">'):]
    assert '<td class="processor">&mdash;</td>' in idle[:idle.index("</tr>")]  # not loaded since start: not placed
    assert (record["gpu_layers"], record["processor"], record["host_bytes"], record["offload_note"]) == (
        "0/5", "CPU", 0, note)
    assert f"model auto: n_gpu_layers auto runs on the CPU: {note}" in caplog.messages
    assert not any(r.levelno >= logging.WARNING and "n_gpu_layers" in r.getMessage() for r in caplog.records)


def test_a_reload_places_the_model_anew_and_a_refused_one_keeps_the_serving_placement(
        tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    from appliance.daemon.core import Daemon
    from appliance.daemon.devices import FakeDevice
    from appliance.engine.runtime import Engine

    def config(**model: object) -> object:
        document = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "resync_interval_s": 0,
                    "models": [{"name": "tiny", "path": str(tiny_model), "n_ctx": 256, **model}]}
        return parse_config(yaml.safe_dump(document), base_dir=tmp_path)

    daemon = Daemon(config(), FakeDevice("8GiB", process_used=0), Engine(1))

    def placement() -> tuple[object, ...]:
        record = next(m for m in daemon.snapshot()["models"] if m["name"] == "tiny")
        return record["gpu_layers"], record["offload_note"], daemon.models["tiny"].offload.requested

    async def main() -> None:
        try:
            await daemon.register("a", "tiny")
            assert placement() == ("0/5", None, 0)
            daemon.apply_config(config(n_gpu_layers=-1))
            with caplog.at_level(logging.WARNING, logger="appliance"):
                await daemon.reload_model("tiny")
            assert placement() == ("0/5", "the memory device is a fake one (tests), with no GPU behind it", -1)
            assert "model tiny: n_gpu_layers -1 asks for GPU layers, but the memory device is a fake one (tests), " \
                   "with no GPU behind it: it runs on the CPU (0/5 layers on the GPU)" in caplog.messages
            daemon.apply_config(config(n_gpu_layers=2, vram_bytes="64GiB"))  # over the 8 GiB device's cap
            with pytest.raises(ApplianceError) as denied:
                await daemon.reload_model("tiny")
            assert denied.value.code == "VRAM_LEDGER_DENY"
            assert placement()[2] == -1  # the runtime that still serves was placed for -1
            assert (await daemon.decode("a", 2, "Hi")).generation.generated_tokens == 2
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 120))
