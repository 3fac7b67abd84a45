"""Engine settings held over the file's by a socket connection (line protocol ``TUNE``; ``appliance benchmark
--socket`` measures a running appliance with them): checked as the file's own values would be, and laid over a
config. Pure.

TUNE changes the engine for every client, so it is for whoever may open the socket: its owner and group
(``socket.mode``, ``socket.group``) are trusted. Even so a TUNE never asks for more decode threads than the
process may use (:func:`refuse_threads_over`): on a 2-core box 1024 threads made a 4-token decode take 12 s."""

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
VALUE_WORDS = "one word without spaces (a number, true/false, auto or [a,b])"
"""What a TUNE value is, for its error messages: the line protocol splits settings at spaces."""


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
        if isinstance(section[name], dict):
            raise ApplianceError("BAD_REQUEST", f"{key}: a TUNE value is {VALUE_WORDS}, not a mapping like "
                                                f"{text[:64]!r}", {"key": key})
    try:
        checked = parse_config(yaml.safe_dump({"engine": section}), source=Path(SOURCE), check_files=False)
    except ConfigInvalid as exc:
        problem = exc.problems[0]
        raise ApplianceError("BAD_REQUEST", f"{problem.path or SOURCE}: {problem.message}",
                             {"key": problem.path}) from None
    return {name: getattr(checked.engine, name) for name in section}


def refuse_threads_over(values: Mapping[str, Any], usable_cores: int) -> None:
    """BAD_REQUEST naming the maximum when ``values`` (:func:`engine_values`) ask for more ``threads`` than
    ``usable_cores``."""
    threads = values.get("threads")
    if threads is not None and threads > usable_cores:
        raise ApplianceError("BAD_REQUEST", f"engine.threads: at most {usable_cores}, the cores this process may use "
                                            f"(got {threads})", {"key": "engine.threads", "maximum": usable_cores})


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
