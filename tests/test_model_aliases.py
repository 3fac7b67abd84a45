"""Model aliases (``models[].aliases``): validated strictly, accepted on every surface, live on reload."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from harness import RawPeer, running

from appliance.config.validate import ConfigInvalid, parse_config
from appliance.protocol import messages as m

ALIASES = ["gpt-4.1", "claude-sonnet-4-5", "openai/gpt-4o"]


def problems(models: list[dict]) -> list[str]:
    text = yaml.safe_dump({"models": models})
    with pytest.raises(ConfigInvalid) as info:
        parse_config(text, check_files=False)
    return [str(problem) for problem in info.value.problems]


def test_aliases_are_read_with_their_model() -> None:
    config = parse_config(yaml.safe_dump({"models": [{"name": "a", "path": "a.gguf", "aliases": ALIASES},
                                                     {"name": "b", "path": "b.gguf"}]}), check_files=False)
    assert config.models[0].aliases == tuple(ALIASES) and config.models[1].aliases == ()
    assert config.named("openai/gpt-4o") is config.models[0] and config.named("a") is config.models[0]
    assert config.named("b") is config.models[1] and config.named("gpt-5") is None
    assert config.model("gpt-4.1") is None  # by name only


@pytest.mark.parametrize(("models", "words"), [
    ([{"name": "a", "path": "a", "aliases": ["b"]}, {"name": "b", "path": "b"}],
     "models[0].aliases: alias 'b' is the name of models[1]"),
    ([{"name": "a", "path": "a", "aliases": ["x"]}, {"name": "b", "path": "b", "aliases": ["x"]}],
     "models[1].aliases: alias 'x' is already an alias of models[0]"),
    ([{"name": "a", "path": "a", "aliases": ["x", "x"]}], "alias 'x' is listed twice"),
    ([{"name": "a", "path": "a", "aliases": ["a"]}], "alias 'a' is the name of models[0]"),
    ([{"name": "a", "path": "a", "aliases": ["has space"]}], "each alias must be 1-128 of"),
    ([{"name": "a", "path": "a", "aliases": ["-dash"]}], "starting with a letter or digit"),
    ([{"name": "a", "path": "a", "aliases": [12]}], "(got 12)"),
    ([{"name": "a", "path": "a", "aliases": "gpt-4.1"}], "must be a list of names"),
    ([{"name": "a", "path": "a", "aliases": ["x" * 129]}], "each alias must be 1-128"),
])
def test_bad_aliases_are_refused_naming_the_collision(models: list[dict], words: str) -> None:
    found = problems(models)
    assert any(words in problem for problem in found), found


def test_every_surface_takes_an_alias(tiny_model: Path) -> None:
    models = {"demo": {"path": str(tiny_model), "n_ctx": 256, "aliases": ALIASES}}
    with running(models, model_dirs=[tiny_model.parent]) as app:
        reply = app.line("REGISTER cli gpt-4.1")
        assert reply.startswith("OK") and "model=demo" in reply, reply
        assert app.daemon.agents["cli"].model.key == "demo"
        peer = RawPeer(app.socket)
        try:
            peer.send({"type": "INFER_REQUEST", "task_id": "t", "model": "claude-sonnet-4-5", "prompt": "Hello",
                       "max_tokens": 3, "temperature": 0})
            end = peer.read_until_end("t")[-1]
        finally:
            peer.close()
        assert isinstance(end, m.TaskComplete) and end.usage.completion_tokens == 3, end
        url = app.appliance.http_url
        body = {"model": "openai/gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                "temperature": 0}
        chat = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3, chat.text
        listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [(entry["id"], entry["root"]) for entry in listed] == [("demo", "demo")] + [(a, "demo") for a in ALIASES]
        one = httpx.get(f"{url}/v1/models/openai/gpt-4o", timeout=30)
        assert one.status_code == 200 and one.json()["root"] == "demo"
        unknown = httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "gpt-5"}, timeout=60)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "UNKNOWN_MODEL"
        assert len(app.daemon.models) == 1  # one model, however many names


def test_aliases_change_live_without_a_reload_of_the_weights(tiny_model: Path) -> None:
    models = {"demo": {"path": str(tiny_model), "n_ctx": 256, "aliases": ["old-name"]}}
    with running(models, model_dirs=[tiny_model.parent], watch=True) as app:
        assert app.line("REGISTER a old-name").startswith("OK")
        runtime = app.daemon.models["demo"].runtime
        doc = yaml.safe_load(app.config_file.read_text())
        doc["models"][0]["aliases"] = ["new-name"]
        app.edit(yaml.safe_dump(doc, sort_keys=False))
        record = app.reload()
        assert record.result == "applied" and "demo updated in place" in record.applied, record
        assert app.daemon.models["demo"].runtime is runtime
        assert app.line("REGISTER b new-name").startswith("OK")
        refused = app.line("REGISTER c old-name")
        assert refused.startswith("ERR UNKNOWN_MODEL"), refused
