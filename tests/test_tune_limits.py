"""TUNE's limits: no more decode threads than the usable cores (refused, naming the maximum), a value cut at a
space or written as a mapping refused naming its key; and the engine itself never decodes with more threads than
cores, whatever the file says (clamped, logged)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from harness import running
from test_daemon_core import Env, run

from appliance.client.lines import request as line_request
from appliance.config import tune
from appliance.daemon.adaptive import usable_cores
from appliance.errors import ApplianceError
from appliance.protocol import lines


def test_threads_above_the_usable_cores_are_refused_naming_the_maximum() -> None:
    with pytest.raises(ApplianceError) as caught:
        tune.refuse_threads_over({"threads": 5, "adaptive": False}, 4)
    assert caught.value.code == "BAD_REQUEST" and "at most 4" in caught.value.message
    assert caught.value.details == {"key": "engine.threads", "maximum": 4}
    for values in ({"threads": 4}, {"threads": 0}, {"adaptive": False}):  # 0: the adaptive engine chooses
        tune.refuse_threads_over(values, 4)


@pytest.mark.parametrize("line", ["TUNE engine.live_slots={a: 1}", "TUNE engine.live_slots=1 2",
                                  "TUNE engine.adaptive=false engine.live_slots=[1, 2]"])
def test_a_value_cut_at_a_space_names_its_key(line: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        lines.parse_line(line)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details == {"key": "engine.live_slots"}
    assert caught.value.message.startswith("engine.live_slots: a TUNE value is one word without spaces")


def test_a_flow_mapping_value_is_refused_naming_its_key() -> None:
    with pytest.raises(ApplianceError) as caught:
        tune.engine_values({"engine.live_slots": "{a:1}"})
    assert caught.value.code == "BAD_REQUEST" and caught.value.details == {"key": "engine.live_slots"}
    assert "not a mapping" in caught.value.message and "without spaces" in caught.value.message


def test_tune_over_the_socket_refuses_more_threads_than_cores(tiny_model: Path) -> None:
    cores = usable_cores()
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True, http=False) as app:
        reply = lines.parse_reply(line_request(app.socket, f"TUNE engine.threads={cores + 1}", timeout=30))
        assert reply.error is not None and reply.error.code == "BAD_REQUEST"
        assert reply.error.details == {"key": "engine.threads", "maximum": str(cores)}
        assert "tuned" not in app.appliance.config_report() and app.daemon.config.engine.threads == 0
        reply = lines.parse_reply(line_request(app.socket, "TUNE engine.live_slots={a: 1}", timeout=30))
        assert reply.error is not None and reply.error.details == {"key": "engine.live_slots"}
        reply = lines.parse_reply(line_request(app.socket, f"TUNE engine.threads={cores}", timeout=30))
        assert reply.error is None and reply.fields["result"] == "applied"


def test_the_engine_never_decodes_with_more_threads_than_cores(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        await daemon.register("a", "m")
        result = await daemon.decode("a", 2, "Hi")
        cores = daemon.adaptive.cores
        assert result.threads == cores and [c["threads"] for c in daemon.contexts()] == [cores]

    with caplog.at_level(logging.WARNING, logger="appliance.daemon.adaptive"):
        run(tmp_path, body, engine={"warmup_runs": 0, "threads": 1024})
    assert f"engine.threads: 1024 threads asked, {usable_cores()} usable cores" in caplog.text
