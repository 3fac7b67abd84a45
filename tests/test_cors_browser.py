"""Cross-origin browser clients in a real headless Chromium (Debian's, driven by Playwright): a page served on
another loopback port ``fetch()``es the appliance's chat API. The page of the origin in ``http.cors_origins`` gets
its answer (a preflighted JSON POST, then a read of the reply); the page of another origin is refused by the
browser, and nothing ran on the appliance."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from harness import running

PAGE_HTML = b"<!doctype html><html><head><meta charset='utf-8'><title>a web app</title></head><body>app</body></html>"
CALL = """async ([url, body]) => {
  try {
    const response = await fetch(url + "/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
      headers: {"Content-Type": "application/json", "X-Agent-Id": "page-agent"}});
    const reply = await response.json();
    return {status: response.status, role: reply.choices[0].message.role};
  } catch (error) {
    return {failed: String(error)};
  }
}"""


class PageHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE_HTML)))
        self.end_headers()
        self.wfile.write(PAGE_HTML)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


@contextmanager
def web_page_server() -> Iterator[str]:
    """A web app's server on a free loopback port; yields its origin."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), PageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_of_an_allowed_origin_calls_the_api_and_another_is_refused(browser, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    with web_page_server() as allowed, web_page_server() as other, \
            running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                    http_settings={"cors_origins": [allowed]}) as app:
        url = app.appliance.http_url
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        context = browser.new_context()
        try:
            page = context.new_page()
            page.goto(allowed + "/")
            answer = page.evaluate(CALL, [url, body])
            assert answer == {"status": 200, "role": "assistant"}
            assert "page-agent" in app.daemon.agents  # the preflight let the X-Agent-Id header through
            ran = len(app.daemon.requests)

            refused_page = context.new_page()
            refused_page.goto(other + "/")
            refused = refused_page.evaluate(CALL, [url, body])
            assert "failed" in refused and "Failed to fetch" in refused["failed"]
            assert len(app.daemon.requests) == ran  # the browser stopped at the refused preflight
        finally:
            context.close()
