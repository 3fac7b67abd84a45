"""A serving process imports only what serving needs: the modules that only other commands, the admin page's
writes or a GPU use are imported where they are used, so that an idle ``appliance run`` stays small.

The check runs the appliance's real ``main(["run", ...])`` on a real tiny model in a child process
(``tests/serving_modules.py``), loads the model and decodes through the socket, serves a chat completion over HTTP,
then reads the child's ``sys.modules``. The resident memory this saves is a benchmark figure
(``benchmarks/idle_memory.py``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from harness import config_text

from appliance.benchmark.servers import free_port
from appliance.daemon import devices
from appliance.engine import gguf_meta

PROBE = Path(__file__).resolve().parent / "serving_modules.py"
PROBE_TIMEOUT_S = 180

NOT_SERVING = {
    "gguf": "the GGUF writer and reader package (gguf_meta keeps its own block-size table)",
    "tqdm": "the terminal progress bar of `appliance benchmark`",
    "ruamel": "the comment-keeping config writer (models add, benchmark --apply, the admin page's writes)",
    "huggingface_hub": "`appliance models pull`",
    "appliance.benchmark.apply": "writing a benchmark's advice into the config",
    "appliance.benchmark.runner": "`appliance benchmark`",
    "appliance.config.roundtrip": "the comment-keeping config writer",
    "appliance.models": "`appliance models add/pull` and the admin page's add form",
    "appliance.engine.tinymodel": "writing a demo model that is missing",
    "appliance.client": "the command-line clients",
    "llama_cpp.llama": "llama-cpp-python's high-level API (the engine binds llama.cpp's C API alone)",
    "diskcache": "llama-cpp-python's prompt cache (its high-level API)",
    "jinja2": "a model's chat template (the demo model has none) and the admin page's first view",
    "difflib": "the hint of an unknown key in a config that has one",
    "numpy": "a draw with a grammar or log-probabilities, and embeddings (a plain one samples in C)",
    "appliance.http.admin": "the admin page (its routes are imported at its first request)",
    "markupsafe": "the admin page's templates",
    "appliance.http.responses": "the Responses API (imported at its first request)",
    "appliance.http.anthropic": "the Anthropic Messages API (imported at its first request)",
    "appliance.http.anthropic_schema": "the Anthropic Messages API's bodies and error envelope",
    "appliance.http.embeddings": "`POST /v1/embeddings` (imported at its first request)",
    "appliance.http.metrics": "`GET /metrics` (imported at the first scrape; requests are counted without it)",
    "prometheus_client": "writing `/metrics` (imported at the first scrape)",
}
"""Modules (and their submodules) a serving process must not have imported, and who uses them instead."""


def imported(modules: list[str], name: str) -> list[str]:
    return [module for module in modules if module == name or module.startswith(name + ".")]


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, object]:
    """What ``appliance run`` (device auto, as shipped) had imported once its model was loaded and had decoded."""
    state = tmp_path_factory.mktemp("serving")
    models = state / "models"
    models.mkdir()
    shutil.copy(tiny_model, models / "tiny.gguf")
    config = state / "appliance.yaml"
    config.write_text(config_text({"tiny": {"path": str(models / "tiny.gguf"), "n_ctx": 256}}, state=state,
                                  model_dirs=[models], device="auto", http={"port": free_port()}))
    out = state / "modules.json"
    done = subprocess.run([sys.executable, str(PROBE), str(config), "tiny", str(out)], capture_output=True,
                          text=True, timeout=PROBE_TIMEOUT_S)
    assert out.exists(), f"the probe wrote nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
    result: dict[str, object] = json.loads(out.read_text())
    assert "error" not in result, f"{result.get('error')}\n{done.stderr[-3000:]}"
    return result


def test_the_probe_saw_a_serving_process_with_its_model_loaded(serving: dict[str, object]) -> None:
    replies = serving["replies"]
    assert isinstance(replies, list) and len(replies) == 2
    assert all(not reply.startswith("ERR") for reply in replies), replies
    assert "generated_tokens=2" in replies[1]
    answers = serving["http"]
    assert isinstance(answers, list) and len(answers) == 2
    (health_status, _), (chat_status, chat_body) = answers
    assert health_status == 200
    assert chat_status == 200, chat_body
    assert json.loads(chat_body)["usage"]["completion_tokens"] == 2
    modules = serving["modules"]
    assert isinstance(modules, list)
    assert {"llama_cpp.llama_cpp", "appliance.app", "appliance.http.app", "appliance.http.openai",
            "appliance.http.requestcounts"} <= set(modules)


@pytest.mark.parametrize("name", sorted(NOT_SERVING))
def test_serving_process_does_not_import(serving: dict[str, object], name: str) -> None:
    modules = serving["modules"]
    assert isinstance(modules, list)
    assert imported(modules, name) == [], f"a serving process imported {name}, needed only for {NOT_SERVING[name]}"


def test_pynvml_is_imported_only_where_nvml_can_load(serving: dict[str, object]) -> None:
    """``device: auto`` asks NVML for a GPU only when the driver's library loads; a CPU-only box never imports
    pynvml."""
    modules = serving["modules"]
    assert isinstance(modules, list)
    if devices.nvml_library_loads():
        pytest.skip("the NVML library loads on this machine: `device: auto` uses pynvml")
    assert imported(modules, "pynvml") == []


def test_gguf_block_sizes_equal_gguf_py() -> None:
    """gguf_meta's table of ggml block sizes is gguf-py's ``GGML_QUANT_SIZES`` (a new gguf release adding a type
    fails here until the table has it)."""
    upstream = {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}
    assert dict(gguf_meta.GGML_BLOCK_SIZES) == upstream
