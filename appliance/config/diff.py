"""Compare two validated configs for hot reload (SPEC C3): :func:`diff` returns a :class:`ConfigDiff`. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import reduce
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
        parts = (("added models", self.added_models), ("removed models", self.removed_models),
                 ("changed models", [f"{n} ({', '.join(self.model_fields[n])})" for n in self.changed_models]),
                 ("changed settings", self.changed_settings), ("restart needed for", self.restart_settings))
        return "; ".join(f"{label}: {', '.join(names)}" for label, names in parts if names) or "no changes"

    __str__ = summary


def diff(old: Config, new: Config) -> ConfigDiff:
    """The :class:`ConfigDiff` from ``old`` to ``new`` (``source`` and ``base_dir`` are not compared)."""
    before, after = {m.name: m for m in old.models}, {m.name: m for m in new.models}
    fields = {name: tuple(f.name for f in dataclasses.fields(ModelConfig)
                          if getattr(before[name], f.name) != getattr(m, f.name))
              for name, m in after.items() if name in before and before[name] != m}
    def get(cfg: Config, key: str) -> Any:
        return reduce(getattr, key.split("."), cfg)
    settings = tuple(s.key for s in schema.SETTINGS
                     if not s.key.startswith("models") and get(old, s.key) != get(new, s.key))
    fixed = {s.name for s in schema.SETTINGS if s.section == "models" and not s.live}
    return ConfigDiff(added_models=tuple(n for n in after if n not in before),
                      removed_models=tuple(n for n in before if n not in after),
                      changed_models=tuple(fields),
                      reload_models=tuple(n for n, fs in fields.items() if fixed.intersection(fs)),
                      changed_settings=settings,
                      restart_settings=tuple(k for k in settings if not schema.BY_KEY[k].live),
                      model_fields=fields)
