"""Engine settings held over the file's by a socket connection (line protocol ``TUNE``; ``appliance benchmark
--socket`` measures a running appliance with them): checked as the file's own values would be, and laid over a
config. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from appliance.config.types import Config
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.errors import ApplianceError

SOURCE = "TUNE"


def engine_values(settings: Mapping[str, str]) -> dict[str, Any]:
    """``{"engine.<name>": text}`` as the engine's typed values by field name (``{"adaptive": False}``), checked by
    the config's own rules; BAD_REQUEST naming the first value it refuses."""
    section: dict[str, Any] = {}
    for key, text in settings.items():
        _, _, name = key.partition(".")
        try:
            section[name] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ApplianceError("BAD_REQUEST", f"{key}: {text[:64]!r} is not a value", {"key": key}) from None
    try:
        checked = parse_config(yaml.safe_dump({"engine": section}), source=Path(SOURCE), check_files=False)
    except ConfigInvalid as exc:
        problem = exc.problems[0]
        raise ApplianceError("BAD_REQUEST", f"{problem.path or SOURCE}: {problem.message}",
                             {"key": problem.path}) from None
    return {name: getattr(checked.engine, name) for name in section}


def merged(tunings: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several connections' tunings as one: a later one wins a key both set."""
    values: dict[str, Any] = {}
    for tuning in tunings:
        values.update(tuning)
    return values


def tuned(config: Config, values: Mapping[str, Any]) -> Config:
    """``config`` with its engine settings replaced by ``values`` (field names)."""
    if not values:
        return config
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, **values))
