from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 4-layer, 256-wide random-weight llama GGUF, made once per test session."""
    from appliance.engine.tinymodel import write_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_tiny_model(path, layers=4, dim=256, seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, different tiny model (other seed, other width)."""
    from appliance.engine.tinymodel import write_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny_b.gguf"
    write_tiny_model(path, layers=2, dim=128, seed=2)
    return path


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose KV cache is large enough for RSS to show a resize: 4 layers x 512, 4096 cells = 32 MiB f16."""
    from appliance.engine.tinymodel import write_tiny_model

    path = tmp_path_factory.mktemp("adaptive") / "wide.gguf"
    write_tiny_model(path, layers=4, dim=512, n_ctx_train=4096, seed=3)
    return path


@pytest.fixture(scope="module")
def weights(tiny_model: Path) -> Iterator[Any]:
    """The tiny model's weights (:class:`~appliance.engine.batched.ModelWeights`), loaded once per module."""
    from appliance.engine.batched import ModelWeights

    with ModelWeights(tiny_model) as loaded:
        yield loaded


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model: Path, tiny_model_b: Path) -> Path:
    """A model folder of this test's own holding both tiny models (``tiny.gguf``, ``tiny_b.gguf``); a test module
    may define its own ``model_dir`` instead."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "tiny.gguf")
    shutil.copy(tiny_model_b, folder / "tiny_b.gguf")
    return folder


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's headless Chromium driven by Playwright (tests/test_admin_browser.py, the Benchmarks tab's test).
    One per module, never per session: Playwright's sync API holds an event loop on the main thread while it runs,
    and every later ``asyncio.run`` of the session would fail."""
    if not CHROMIUM.exists():
        pytest.fail(f"Debian's chromium is missing ({CHROMIUM}): run scripts/setup.sh test, which installs it with "
                    "apt-get (or: apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: install the test extra (pip install -e '.[test]'); the browser is "
                    "Debian's chromium, never 'playwright install'")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def vendored() -> Path:
    """The pinned llama-cpp-python sdist's real tokenizers (``ggml-vocab-<name>.gguf``) and chat templates
    (``templates/<name>.jinja``), fetched once per machine into a cache folder (tests/vendored.py)."""
    from vendored import VendoredUnavailable, vendored_folder

    try:
        return vendored_folder()
    except VendoredUnavailable as exc:
        pytest.skip(f"the llama-cpp-python sdist cannot be had, so neither can its vocab files: {exc}")


ChatModel = Callable[..., Path]


@pytest.fixture(scope="session")
def chat_model(vendored: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatModel:
    """``chat_model(vocab, template, special_tokens=())``: a 2-layer, 64-wide random-weight model with the tokenizer of
    ``ggml-vocab-<vocab>.gguf``, ``templates/<template>.jinja`` as its chat template (None: the vocab file's own)
    and ``special_tokens`` appended as control tokens; each written once per session."""
    from vendored import template_names, template_path, vocab_names, vocab_path

    from appliance.engine.tinymodel import write_tiny_model

    folder = tmp_path_factory.mktemp("chat-models")
    made: dict[tuple[str, str | None, tuple[str, ...]], Path] = {}

    def make(vocab: str, template: str | None, special_tokens: Sequence[str] = ()) -> Path:
        key = (vocab, template, tuple(special_tokens))
        if key in made:
            return made[key]
        if vocab not in vocab_names(vendored):
            pytest.fail(f"the sdist has no ggml-vocab-{vocab}.gguf; it has {', '.join(vocab_names(vendored))}")
        if template is not None and template not in template_names(vendored):
            pytest.fail(f"the sdist has no templates/{template}.jinja; it has {', '.join(template_names(vendored))}")
        text = None if template is None else template_path(vendored, template).read_text(encoding="utf-8")
        made[key] = write_tiny_model(folder / f"{len(made)}-{vocab}.gguf", layers=2, dim=64,
                                     vocab_from=vocab_path(vendored, vocab), chat_template=text,
                                     special_tokens=special_tokens)
        return made[key]

    return make


@pytest.fixture(scope="session", autouse=True)
def reference_loads_like_the_engine() -> Iterator[None]:
    """llama-cpp-python's ``Llama`` (the reference several tests compare the engine with) loads its weights with the
    engine's choice of llama.cpp's CPU extra buffer types (``appliance.engine.batched.EXTRA_BUFFERS``): on a CPU
    with AMX they change the numerics, and the two would part on a near tie."""
    from appliance.engine.batched import EXTRA_BUFFERS
    from appliance.engine.bindings import llama_cpp

    default_params = llama_cpp.llama_model_default_params

    def engine_params() -> Any:
        params = default_params()
        params.use_extra_bufts = EXTRA_BUFFERS
        return params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp, "llama_model_default_params", engine_params)
        yield
