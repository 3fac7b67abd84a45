"""Compare two validated configs for hot reload (SPEC C3): :func:`diff` returns a :class:`ConfigDiff`. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.config import schema
from appliance.config.types import Config, ModelConfig

__all__ = ["ConfigDiff", "diff"]


@dataclass(frozen=True)
class ConfigDiff:
    """What changed between two configs: model names and setting key paths, in schema order.

    ``reload_models``: changed models whose change needs the weights reloaded (a non-live key: path, n_ctx, …);
    others (idle_ttl_s, generate_if_missing) apply in place. ``restart_settings``: changed settings that take
    effect only after a restart (data_dir, device, socket.*, http.host/port). ``model_fields``: name -> keys.
    """

    added_models: tuple[str, ...] = ()
    removed_models: tuple[str, ...] = ()
    changed_models: tuple[str, ...] = ()
    reload_models: tuple[str, ...] = ()
    changed_settings: tuple[str, ...] = ()
    restart_settings: tuple[str, ...] = ()
    model_fields: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    @property
    def empty(self) -> bool:
        return not (self.added_models or self.removed_models or self.changed_models or self.changed_settings)

    def summary(self) -> str:
        """One line for logs and the reload history, e.g. ``added models: b; changed settings: engine.threads``."""
        changed_models = [f"{name} ({', '.join(self.model_fields[name])})" for name in self.changed_models]
        parts = [
            ("added models", self.added_models),
            ("removed models", self.removed_models),
            ("changed models", changed_models),
            ("changed settings", self.changed_settings),
            ("restart needed for", self.restart_settings),
        ]
        lines = [f"{label}: {', '.join(names)}" for label, names in parts if names]
        return "; ".join(lines) or "no changes"

    __str__ = summary


def _setting(config: Config, key: str) -> Any:
    """The value of the (non-model) setting ``key`` in ``config``: ``engine.threads`` is ``config.engine.threads``."""
    value: Any = config
    for name in key.split("."):
        value = getattr(value, name)
    return value


def _changed_fields(before: ModelConfig, after: ModelConfig) -> tuple[str, ...]:
    """The names of the fields that differ between two configs of one model, in declaration order."""
    changed = []
    for declared in dataclasses.fields(ModelConfig):
        if getattr(before, declared.name) != getattr(after, declared.name):
            changed.append(declared.name)
    return tuple(changed)


def diff(old: Config, new: Config) -> ConfigDiff:
    """The :class:`ConfigDiff` from ``old`` to ``new`` (``source`` and ``base_dir`` are not compared)."""
    before = {model.name: model for model in old.models}
    after = {model.name: model for model in new.models}
    model_fields: dict[str, tuple[str, ...]] = {}
    for name, model in after.items():
        if name in before and before[name] != model:
            model_fields[name] = _changed_fields(before[name], model)

    reload_keys = {s.name for s in schema.SETTINGS if s.section == "models" and not s.live}
    reload_models = []
    for name, changed in model_fields.items():
        if reload_keys.intersection(changed):
            reload_models.append(name)

    changed_settings = []
    for setting in schema.SETTINGS:
        if setting.key.startswith("models"):
            continue
        if _setting(old, setting.key) != _setting(new, setting.key):
            changed_settings.append(setting.key)
    restart_settings = [key for key in changed_settings if not schema.BY_KEY[key].live]

    return ConfigDiff(
        added_models=tuple(name for name in after if name not in before),
        removed_models=tuple(name for name in before if name not in after),
        changed_models=tuple(model_fields),
        reload_models=tuple(reload_models),
        changed_settings=tuple(changed_settings),
        restart_settings=tuple(restart_settings),
        model_fields=model_fields,
    )
