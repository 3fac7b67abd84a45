"""The admin page's model pickers: the options of a model ``<select>`` (``templates/_model_picker.html``), in
groups: the configured models, their aliases, and, where a form takes a GGUF path, the GGUF files in
``model_dirs`` that no model is configured with. :func:`model_groups` is pure; :func:`unconfigured_files` lists
the folders."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.config.types import Config

MAX_FILES = 200
"""GGUF files offered at most (the first by path): a picker stays usable on a box with a large model library."""
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class Choice:
    """One option: ``value`` is what the form sends (a model name, an alias, a path), ``label`` what it shows."""

    value: str
    label: str


@dataclass(frozen=True)
class ChoiceGroup:
    label: str
    choices: tuple[Choice, ...]


def model_groups(config: Config, *, known: Iterable[str] = (), files: Sequence[Path] = ()) -> list[ChoiceGroup]:
    """The picker's groups: "Models" (the configured ones in config order, then ``known``, other models the daemon
    holds: one loaded by its path), "Aliases" (each labelled with its model), and "GGUF files in model_dirs"
    (``files``); empty groups left out."""
    names = [spec.name for spec in config.models]
    names += [name for name in known if name not in names]
    groups = [ChoiceGroup("Models", tuple(Choice(name, name) for name in names)),
              ChoiceGroup("Aliases", tuple(Choice(alias, f"{alias} \u2192 {spec.name}")
                                           for spec in config.models for alias in spec.aliases)),
              ChoiceGroup("GGUF files in model_dirs", tuple(Choice(str(path), str(path)) for path in files))]
    return [group for group in groups if group.choices]


def file_groups(files: Sequence[Path]) -> list[ChoiceGroup]:
    """The files only (the "Add a model" form), none when there are none."""
    return [ChoiceGroup("GGUF files in model_dirs", tuple(Choice(str(path), str(path)) for path in files))] \
        if files else []


def configured_names(config: Config) -> list[ChoiceGroup]:
    """The configured models only (a benchmark runs on one of the config file's models by name)."""
    return [group for group in model_groups(config) if group.label == "Models"]


def unconfigured_files(config: Config, limit: int = MAX_FILES) -> list[Path]:
    """The ``*.gguf`` files directly inside each of ``model_dirs`` (missing folders skipped) that no configured model
    names, sorted, at most ``limit``."""
    configured = {_resolved(spec.path) for spec in config.models}
    found: set[Path] = set()
    for folder in config.model_dirs:
        try:
            entries = list(Path(folder).iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.name.lower().endswith(GGUF_SUFFIX) and entry.is_file() and _resolved(entry) not in configured:
                found.add(entry)
    return sorted(found)[:limit]


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path
