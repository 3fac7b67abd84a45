from __future__ import annotations

import shutil
from pathlib import Path

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


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model: Path, tiny_model_b: Path) -> Path:
    """A model folder of this test's own holding both tiny models (``tiny.gguf``, ``tiny_b.gguf``); a test module
    may define its own ``model_dir`` instead."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "tiny.gguf")
    shutil.copy(tiny_model_b, folder / "tiny_b.gguf")
    return folder
