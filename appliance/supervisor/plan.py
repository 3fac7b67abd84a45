"""What a hot reload does (SPEC C3): :func:`plan` turns a :class:`~appliance.config.diff.ConfigDiff` into a
:class:`ReloadPlan`, which the applier carries out. Pure: no IO, no daemon.

The rules, one per kind of change:

* an added model is registrable at once: the new config is all it needs;
* a removed model is *retired*: it takes no new agents, its agents keep working, and it unloads when its last
  agent leaves;
* a model whose file or context settings changed (a key that is not live: path, n_ctx, cache_type, ...) is
  reloaded alone, its agents staying registered; a change of live model keys only (idle_ttl_s) applies in place;
* a loaded model whose file was replaced in place (same path, new content) is reloaded the same way;
* the socket (path, mode, group) and the HTTP address (host, port) are rebound: the new listener first, then the
  old one closes;
* ``device`` and ``data_dir`` (the settings the schema marks not live) need a restart: the
  reload applies everything else, keeps their running values, and says that these wait;
* every other setting is read at use time, so it applies to the next request once the config is swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.diff import ConfigDiff

SOCKET_SETTINGS = ("socket.path", "socket.mode", "socket.group")
HTTP_SETTINGS = ("http.host", "http.port")


@dataclass(frozen=True)
class ReloadPlan:
    """What to do, in the order the applier does it: swap the config (``live_settings`` and ``add_models`` take
    effect), retire, reload, rebind; ``restart_needed`` is reported, not applied."""

    add_models: tuple[str, ...] = ()
    retire_models: tuple[str, ...] = ()
    reload_models: tuple[str, ...] = ()
    live_models: tuple[str, ...] = ()  # changed in live keys only: applied in place
    live_settings: tuple[str, ...] = ()
    rebind_socket: bool = False
    rebind_http: bool = False
    restart_needed: tuple[str, ...] = ()
    replaced_files: tuple[str, ...] = ()  # loaded models whose file was replaced in place: reloaded too

    @property
    def empty(self) -> bool:
        return not (self.add_models or self.retire_models or self.reload_models or self.live_models
                    or self.live_settings or self.rebind_socket or self.rebind_http or self.restart_needed
                    or self.replaced_files)

    def summary(self) -> str:
        """One line: what is applied and what waits for a restart (``no changes`` when empty)."""
        parts = []
        if self.add_models:
            parts.append(f"added {', '.join(self.add_models)}")
        if self.retire_models:
            parts.append(f"retiring {', '.join(self.retire_models)}")
        if self.reload_models:
            parts.append(f"reloading {', '.join(self.reload_models)}")
        if self.replaced_files:
            parts.append(f"reloading replaced files of {', '.join(self.replaced_files)}")
        if self.live_models:
            parts.append(f"updated {', '.join(self.live_models)}")
        if self.live_settings:
            parts.append(f"settings {', '.join(self.live_settings)}")
        if self.rebind_socket:
            parts.append("rebinding the socket")
        if self.rebind_http:
            parts.append("rebinding HTTP")
        if self.restart_needed:
            parts.append(f"restart needed for {', '.join(self.restart_needed)}")
        return "; ".join(parts) or "no changes"


def plan(diff: ConfigDiff, replaced: tuple[str, ...] = ()) -> ReloadPlan:
    """The :class:`ReloadPlan` for ``diff`` (see the module docstring for the rules); ``replaced``: the loaded
    models whose file on disk changed although their config did not."""
    reload_models = tuple(name for name in diff.changed_models if name in diff.reload_models)
    live_models = tuple(name for name in diff.changed_models if name not in diff.reload_models)
    restart = []
    live = []
    for key in diff.changed_settings:
        if key in diff.restart_settings:
            restart.append(key)
        elif key not in SOCKET_SETTINGS and key not in HTTP_SETTINGS:
            live.append(key)
    return ReloadPlan(
        add_models=diff.added_models,
        retire_models=diff.removed_models,
        reload_models=reload_models,
        live_models=live_models,
        live_settings=tuple(live),
        rebind_socket=any(key in SOCKET_SETTINGS for key in diff.changed_settings),
        rebind_http=any(key in HTTP_SETTINGS for key in diff.changed_settings),
        restart_needed=tuple(restart),
        replaced_files=tuple(name for name in replaced
                             if name not in reload_models and name not in diff.removed_models),
    )
