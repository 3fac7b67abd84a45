"""The registry page's "Add a model" form: a GGUF file already in a ``model_dirs`` folder (picked from those no model
is configured with), a name (default: from the file name) and an optional ``n_ctx``, added to the running config's
file by :func:`appliance.models.add.add_model`, the same path as ``appliance models add`` (header check, trial load
in a child process, the entry written with every comment kept), then a reload so the model serves at once.

The file must lie inside ``model_dirs``: the form never makes the appliance read, link or copy a file from elsewhere
on the box (``FORBIDDEN``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.config import schema
from appliance.daemon import policy
from appliance.errors import ApplianceError
from appliance.http.admin import render

if TYPE_CHECKING:
    from appliance.app import Appliance

MAX_PATH_CHARS = 4096
N_CTX = schema.BY_KEY["models[].n_ctx"]


def n_ctx_field(text: str) -> int | None:
    """The form's ``n_ctx``: None when empty (the default), else an integer in the setting's range; BAD_REQUEST."""
    if not text:
        return None
    assert N_CTX.minimum is not None and N_CTX.maximum is not None
    if not (text.isascii() and text.isdigit() and len(text) <= 8) or \
            not N_CTX.minimum <= int(text) <= N_CTX.maximum:
        raise ApplianceError("BAD_REQUEST", f"n_ctx must be an integer {N_CTX.minimum:g}..{N_CTX.maximum:g}",
                             {"field": "n_ctx", "value": text[:16]})
    return int(text)


def file_field(appliance: Appliance, text: str) -> Path:
    """The form's file: a path inside one of ``model_dirs`` (FORBIDDEN otherwise)."""
    path = Path(os.path.realpath(text))
    folders = [Path(os.path.realpath(folder)) for folder in appliance.config.model_dirs]
    if not policy.inside(path, folders):
        raise ApplianceError("FORBIDDEN", "the admin page adds model files that are already inside a model_dirs "
                                          "folder (put the file there first)",
                             {"file": text[:256], "model_dirs": [str(folder) for folder in folders]})
    return path


async def add(request: Request) -> Response:
    from appliance.models.add import add_model  # lazy: the config writer (ruamel.yaml) only when a model is added

    appliance: Appliance = request.app.state.appliance
    try:
        render.daemon_of(request)
        fields = await render.form_fields(request)
        if appliance.config_path is None or appliance.reloader is None:
            raise ApplianceError("BAD_REQUEST", "this appliance was started without a config file: there is no "
                                 "file to add the model to", {"config_file": None})
        file = file_field(appliance, render.required(fields, "file", max_chars=MAX_PATH_CHARS))
        name = fields.get("name") or None
        n_ctx = n_ctx_field(fields.get("n_ctx", ""))
        added = await asyncio.to_thread(add_model, appliance.config_path, file, name=name, n_ctx=n_ctx,
                                        data_dir=appliance.overrides["data_dir"])
        record = await appliance.reloader.reload("api")
    except ApplianceError as error:
        return render.result("The model was not added.", error)
    spec = appliance.config.model(added.name)
    if spec is None:  # the file holds it; the running config does not
        return render.result(f"Model {added.name} was added to {added.config}, but the reload did not apply it.",
                             ApplianceError("INTERNAL", record.line(), {"reload": record.result}))
    return render.result(f"Model {added.name} added to {added.config} (file {added.path}, context {spec.n_ctx}); "
                         f"the config was reloaded: it serves now.")


routes = [Route("/admin/registry/add-model", add, methods=["POST"])]
