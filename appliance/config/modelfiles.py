"""Configured models whose GGUF file is not there: the appliance serves the other models and these as ``missing``.

A model file lost from a disk (or not copied yet) does not make the config invalid. Such a model is ``missing``: health
is ``degraded`` with a reason naming the model, its file and where the config says so (``appliance.yaml:31
models[2].path``), a request for it is refused with ``MODEL_MISSING``, and it serves again as soon as the file is
there: existence is checked at use time, never remembered.

Pure: the caller passes the existence check (the daemon and ``appliance config check``: ``Path.is_file``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.config.types import Config
from appliance.errors import ApplianceError

__all__ = ["MissingModel", "missing_model", "missing_models"]

Exists = Callable[[Path], bool]


@dataclass(frozen=True)
class MissingModel:
    """A configured model whose file does not exist: ``key`` is its path's key path (``models[2].path``), ``line``
    the line of that value in ``file`` (None when unknown)."""

    name: str
    path: Path
    key: str
    line: int | None
    file: str

    @property
    def where(self) -> str:
        """Where the config names the file: ``/etc/appliance/appliance.yaml:31 models[2].path``."""
        place = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{place} {self.key}"

    @property
    def reason(self) -> str:
        """One line for health, STATUS and the log."""
        return f"model {self.name} is missing: no such file {self.path} ({self.where})"

    def error(self) -> ApplianceError:
        """The ``MODEL_MISSING`` refusal of a request for this model."""
        return ApplianceError("MODEL_MISSING", f"model {self.name!r} is configured but its file is missing: "
                              f"{self.path} ({self.where}); it serves as soon as the file is there",
                              {"model": self.name, **self.to_dict()})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "key": self.key, "line": self.line, "file": self.file}


def _file_of(config: Config) -> str:
    return "appliance.yaml" if config.source is None else str(config.source)


def missing_model(config: Config, name: str, exists: Exists) -> MissingModel | None:
    """The configured model ``name`` as missing when ``exists`` says its file is not there; None when it is, or when
    no model of ``config`` has that name."""
    for index, model in enumerate(config.models):
        if model.name != name:
            continue
        if exists(model.path):
            return None
        key = f"models[{index}].path"
        return MissingModel(model.name, model.path, key, config.lines.get(key), _file_of(config))
    return None


def missing_models(config: Config, exists: Exists, *, skip_generated: bool = False) -> tuple[MissingModel, ...]:
    """Every configured model whose file ``exists`` does not find, in config order. ``skip_generated``: leave out the
    models with ``generate_if_missing`` (``appliance run`` writes their file at start)."""
    found = []
    for model in config.models:
        if skip_generated and model.generate_if_missing is not None:
            continue
        missing = missing_model(config, model.name, exists)
        if missing is not None:
            found.append(missing)
    return tuple(found)
