"""Hot reload and retirement (SPEC C3): the Daemon's part that changes a running daemon, through two calls,
:meth:`HotReload.apply_config` and :meth:`HotReload.reload_model`; the rules:

* **Admission**: a new ``admission_percent`` re-bases the ledger cap at once. A lower cap never evicts anyone:
  while more is allocated than the cap allows, new loads are refused (``VRAM_LEDGER_DENY``) and STATUS shows
  ``over_cap=yes``, until enough unloads.
* **Removed model (retired)**: it takes no new agents and no stateless requests (its name is unknown; a REGISTER
  of its file by path loads it anew under the path's name). Its agents keep decoding. It unloads as soon as it has
  no agent and nothing in flight (at once if that is already so, else when its last agent leaves or its last
  request ends), then disappears from STATUS; meanwhile STATUS shows it with ``retired=yes``. A model that comes
  back in a later config before it unloaded serves again (reloaded first if its file or context settings changed).
* **Live model keys** (``idle_ttl_s``) apply in place; the model keeps its runtime.
* **Reloaded model** (file or context settings changed): the new estimate is admitted by the ledger under a
  temporary key while the old runtime still serves and holds its bytes; a denial or a failed load leaves the old
  one serving. Then, in one engine job, the old runtime closes and the new one takes its place and its ledger key.
  Its agents stay registered: with the same vocabulary their tokens are kept and re-evaluated on the new weights
  at their next decode; with a different vocabulary their conversations are reset and their next decode result
  carries a one-time notice. Other models and their agents are not touched.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from appliance.config import schema as settings
from appliance.config.validate import Config, ModelConfig
from appliance.daemon import offload, policy
from appliance.daemon.base import DaemonBase, finish, log, log_load_failure
from appliance.daemon.devices import process_bytes
from appliance.daemon.ledger import compute_cap
from appliance.daemon.model import Model, context_key, embedding_key, file_identity, forget_parked, reload_key
from appliance.engine.interface import RuntimeProtocol
from appliance.errors import ApplianceError

RELOAD_KEYS = frozenset(s.name for s in settings.SETTINGS if s.section == "models" and not s.live)
"""The ``models[]`` keys whose change needs the model's weights reloaded (the others apply in place)."""


def needs_reload(before: ModelConfig, after: ModelConfig) -> bool:
    """True when two specs of one model differ in a key that only a reload applies (path, n_ctx, ...)."""
    return any(getattr(before, key) != getattr(after, key) for key in RELOAD_KEYS)


def vocabulary_notice(name: str) -> str:
    return f"conversation reset: model {name} was reloaded with a different vocabulary"


def job_result(job: asyncio.Future[Any]) -> Any:
    """A finished job's value, or None when it failed, was cancelled or has not finished."""
    if not job.done() or job.cancelled() or job.exception() is not None:
        return None
    return job.result()


class HotReload(DaemonBase):
    """Hot reload and retirement of a :class:`~appliance.daemon.core.Daemon` (module docstring)."""

    def apply_config(self, new: Config) -> list[str]:
        """Swap in ``new`` (validated) and apply what takes no load: the ledger cap for ``admission_percent``,
        live model keys in place, retiring removed models and un-retiring returned ones (module docstring).
        Models whose file or context settings changed are left to :meth:`reload_model` (see
        :meth:`models_to_reload`). Returns one short line per thing done."""
        old, self.config = self.config, new
        done: list[str] = []
        cap = compute_cap(self.reading.total, new.admission_percent, self.external)
        if cap != self.ledger.cap:
            self.ledger.set_cap(cap)
            allocated = self.ledger.allocated
            over = f": {allocated} bytes allocated, over it: new loads are refused meanwhile" if allocated > cap else ""
            done.append(f"ledger cap {cap} bytes (admission_percent {new.admission_percent:g}){over}")
        configured = {spec.name for spec in old.models}
        for model in list(self.models.values()):
            spec = new.model(model.key)
            if spec is None:
                if model.key in configured and not model.retired:  # a model registered by path is in no config
                    model.retired = True
                    done.append(f"{model.key} retired: no new agents; it unloads when nothing uses it")
                    log.info("model %s removed from the config: retired (%d agents, %d requests in flight)",
                             model.key, model.refcount, model.inflight)
                    self._settle_retired(model)
                continue
            if model.retired:
                model.retired = False
                done.append(f"{model.key} is back in the config: it serves again")
            if spec == model.spec:
                continue
            if not needs_reload(model.spec, spec):
                model.spec = spec
                done.append(f"{model.key} updated in place")
            elif model.state == "available":
                model.spec = spec
                model.estimate = None
                model.measured = None
                done.append(f"{model.key} is not loaded: its next load uses the new settings")
            else:
                done.append(f"{model.key} changed: it needs a reload")
        if old.engine != new.engine:
            self.adaptive.reconfigure()
            if old.engine.adaptive != new.engine.adaptive:
                done.append("engine: " + ("adaptive" if new.engine.adaptive else "fixed strategy") +
                            " for every loaded model")
        return done

    def replaced_files(self) -> list[str]:
        """The loaded models whose file on disk is no longer the one they were loaded from (replaced in place:
        the config did not change), listed or registered by path; a reload (SIGHUP) reloads them. A retired model
        is not one: it unloads once unused."""
        replaced: list[str] = []
        for name, model in self.models.items():
            if model.retired or model.runtime is None or model.file is None:
                continue
            if file_identity(model.path) != model.file:
                replaced.append(name)
        return replaced

    def reload_spec(self, name: str) -> ModelConfig:
        """The spec :meth:`reload_model` reloads ``name`` with: its spec in the current config, or, for a model
        registered by its path (in no config, and not retired), the spec it was registered with."""
        spec = self.config.model(name)
        if spec is not None:
            return spec
        model = self.models.get(name)
        if model is not None and not model.retired:
            return model.spec
        raise ApplianceError("UNKNOWN_MODEL", f"no model named {name!r}",
                             {"model": name, "known": [m.name for m in self.config.models]})

    def models_to_reload(self) -> list[str]:
        """The models whose loaded runtime no longer matches the config (a file or context setting changed):
        what :meth:`reload_model` should be called for after :meth:`apply_config` (this includes a changed
        model that came back after being retired, which a diff of the two configs calls added)."""
        stale: list[str] = []
        for name, model in self.models.items():
            spec = self.config.model(name)
            if spec is not None and model.state != "available" and needs_reload(model.spec, spec):
                stale.append(name)
        return stale

    async def reload_model(self, name: str) -> str:
        """Reload the model ``name`` with its spec in the current config, or its own for a model registered by
        path (:meth:`reload_spec`; its file or context settings changed, or its file was replaced). Not loaded:
        its next load uses the new spec. Loaded: estimate, trial-check and admit the new figure under
        :func:`reload_key` while the old runtime serves, load, then swap in one engine job (:meth:`_install`).
        Any failure leaves the old runtime serving and the ledger as it was, and raises its
        :class:`ApplianceError`. Returns one line saying what happened."""
        if self.closing:
            raise ApplianceError("SHUTTING_DOWN")
        spec = self.reload_spec(name)
        model = self.models.get(name)
        if model is None:
            return f"{name} is not loaded: its next load uses the new settings"
        async with model.lock:
            if model.runtime is None:
                model.spec = spec
                model.estimate = None
                model.measured = None
                return f"{name} is not loaded: its next load uses the new settings"
            started = time.perf_counter()
            serving = model.offload  # the serving runtime's placement: put back if this reload fails
            try:
                identity = await asyncio.to_thread(file_identity, spec.path)  # before the load: a later change shows
                if model.tuner is not None:
                    model.tuner.reconfigure(self.adaptive.settings(), spec.n_ctx)
                model.shape = None  # the file may have changed
                estimate, context_bytes = await asyncio.to_thread(self.tuned_parts, model, spec)
                await asyncio.to_thread(self.engine.check, spec.path, n_ctx=spec.n_ctx,
                                        n_gpu_layers=model.gpu_layers)
                with self.ledger.reservation(reload_key(name), estimate):
                    kept, reset = await self._replace_runtime(model, spec, estimate, context_bytes)
            except ApplianceError as exc:
                model.offload = serving
                self.counters["denials"] += exc.code == "VRAM_LEDGER_DENY"
                log_load_failure(name, exc)
                log.warning("model %s not reloaded: the loaded one keeps serving", name)
                raise
        self.counters["reloads"] += 1
        model.file = identity
        model.last_used = self.clock()
        log.info("model %s reloaded: estimate %d bytes, %.2f s, %d agents keep their tokens, %d reset", name,
                 estimate, time.perf_counter() - started, kept, reset)
        if model.offload is not None and model.offload.cpu_fallback:  # at each load: loudly
            log.warning("%s", offload.fallback_warning(name, model.offload))
        self._changed()
        if reset:
            return f"{name} reloaded with a different vocabulary ({reset} agents' conversations reset)"
        return f"{name} reloaded ({kept} agents re-evaluate their tokens)"

    async def _replace_runtime(self, model: Model, spec: ModelConfig, estimate: int,
                               context_bytes: int) -> tuple[int, int]:
        """Load ``spec`` next to the serving runtime, let the requests in flight on the old one end (new ones
        wait meanwhile), then install it; a new runtime that was not installed (a failure, or the caller
        cancelled) is closed again. Returns :meth:`_install`'s counts."""
        load = asyncio.ensure_future(self.engine.call(self._load_spare, model, spec))
        try:
            runtime, loaded_bytes = await finish(load)
            model.serving.clear()
            while model.active > 0:
                waiter = asyncio.get_running_loop().create_future()
                self.context_waiters.append(waiter)
                await waiter
            install = asyncio.ensure_future(self.engine.call(self._install, model, spec, estimate, context_bytes,
                                                             runtime, loaded_bytes))
            return await finish(install)
        finally:
            model.serving.set()
            spare = job_result(load)
            if spare is not None and model.runtime is not spare[0]:
                await finish(asyncio.ensure_future(self.engine.call(spare[0].close)))

    def _load_spare(self, model: Model, spec: ModelConfig) -> tuple[RuntimeProtocol, int]:
        """Load ``spec`` while the model's old runtime still serves (engine thread); returns the runtime and the
        process bytes the load added."""
        before = process_bytes(self.device.read())
        runtime = self._engine_load(model, spec)
        return runtime, max(0, process_bytes(self.device.read()) - before)

    def _install(self, model: Model, spec: ModelConfig, estimate: int, context_bytes: int,
                 runtime: RuntimeProtocol, loaded_bytes: int) -> tuple[int, int]:
        """Put ``runtime`` in place of ``model``'s (engine thread, one job, so no decode sees a half-done swap):
        the model's ledger key takes the new estimate (then the temporary key goes: the bytes are never counted
        for neither), the old runtime closes, and each agent on the model forgets its KV state; with a different
        vocabulary its tokens go too and it gets a notice. Returns (agents that keep their tokens, agents reset)."""
        old = model.runtime
        if old is None:
            raise ApplianceError("INTERNAL", f"model {model.key!r} was unloaded during its reload")
        same_vocabulary = old.vocabulary() == runtime.vocabulary()
        model.vocabulary = runtime.vocabulary()
        # The old weights' and context's keys take the new figures; the temporary key's bytes become the new
        # context's key (the new runtime is loaded with its context), so the bytes are never counted for neither.
        self.ledger.release(context_key(model.key))
        self.ledger.release(embedding_key(model.key))  # closes with the old runtime; the next request opens one
        self.ledger.adjust(model.key, estimate - context_bytes)
        if context_bytes:
            self.ledger.adjust(reload_key(model.key), context_bytes)
            self.ledger.rename(reload_key(model.key), context_key(model.key))
        else:
            self.ledger.release(reload_key(model.key))
        try:
            old.close()
        except Exception:  # it is gone from the daemon either way, as in unload
            log.exception("model %s: closing the replaced runtime failed", model.key)
        model.runtime = runtime
        model.spec = spec
        model.estimate = estimate
        model.context_bytes = context_bytes
        model.context_claimed = True  # the new runtime was loaded with its context
        model.context_used = self.clock()
        model.measured = None
        model.kv_bytes_per_token = 0
        kept = 0
        reset = 0
        for agent in list(self.agents.copy().values()):
            if agent.model is not model:
                continue
            conv = agent.conversation
            forget_parked(conv)
            if same_vocabulary:
                kept += 1
            else:
                conv.tokens.clear()
                agent.notice = vocabulary_notice(model.key)
                reset += 1
        try:  # the measured figure's baseline: as if only the new runtime had been loaded
            model.baseline = process_bytes(self.device.read()) - loaded_bytes
        except Exception:
            log.warning("model %s: no device reading after its reload; its measured figure may be off", model.key)
        return kept, reset

    async def drain_retired(self) -> list[str]:
        """Unload every retired model that nothing uses any more and forget it; returns their names."""
        gone: list[str] = []
        for model in [m for m in self.models.values() if m.retired]:
            await self.unload(model, policy.unload_retired, reason="removed from the config")
            if self._forget_retired(model):
                gone.append(model.key)
        return gone

    def _forget_retired(self, model: Model) -> bool:
        """Drop a retired model that is unloaded and unused from :attr:`models` (and so from STATUS)."""
        unused = model.refcount == 0 and model.inflight == 0 and model.state == "available"
        if not (model.retired and unused and self.models.get(model.key) is model):
            return False
        del self.models[model.key]
        log.info("model %s forgotten: removed from the config and unused", model.key)
        self._changed()
        return True

    def _settle_retired(self, model: Model) -> None:
        """Unload ``model`` in the background if it is retired and unused (a caller on the loop cannot wait)."""
        if not policy.unload_retired(model.view()):
            return
        self.background(asyncio.get_running_loop().create_task(self.drain_retired()))

    async def settle(self) -> None:
        """Wait for the background unloads of retired models (tests; shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
