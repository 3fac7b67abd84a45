"""The JSON reply of the completion routes, encoded by the hot paths' codec (:mod:`appliance.protocol.jsoncodec`)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from appliance.protocol import jsoncodec


class JSONReply(JSONResponse):
    """A ``JSONResponse`` whose body is :func:`jsoncodec.dumps` of the content: the bytes starlette's
    ``json.dumps`` wrote, but for how a float with an exponent is written (the codec's docstring says)."""

    def render(self, content: Any) -> bytes:
        return jsoncodec.dumps(content)
