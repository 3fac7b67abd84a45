"""When a connection's requests owe a HEARTBEAT (pure), and the MAGN session's one heartbeat timer on the real daemon:
a long request still gets its beats (streaming or not, started while the timer was armed for others or not), a
short one arms no timer of its own, and no beat follows a request's end."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import RawPeer, running

from appliance.protocol import messages as m
from appliance.server.heartbeat import BeatPlan, beats_due


def test_nothing_in_flight_plans_no_beat_and_no_timer() -> None:
    assert beats_due({}, 10.0, 2.0) == BeatPlan((), None)


def test_a_request_beats_once_its_last_message_is_an_interval_old() -> None:
    assert beats_due({"a": 0.0}, 1.5, 2.0) == BeatPlan((), 2.0)
    assert beats_due({"a": 0.0}, 2.0, 2.0) == BeatPlan(("a",), 4.0)
    assert beats_due({"a": 0.0}, 7.0, 2.0) == BeatPlan(("a",), 9.0)  # a late timer: one beat, then an interval


def test_the_timer_fires_next_when_the_oldest_request_comes_due() -> None:
    plan = beats_due({"old": 0.0, "new": 1.5, "streaming": 0.5}, 2.0, 2.0)
    assert plan == BeatPlan(("old",), 2.5)  # "streaming" sent a token at 0.5: due at 2.5, before "old" again


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        beats_due({"a": 0.0}, 1.0, 0.0)


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "tiny.gguf")
    return folder


def request(task_id: str, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {"type": "INFER_REQUEST", "task_id": task_id, "model": "tiny", "prompt": "Hi", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def timed_until_end(peer: RawPeer, task_id: str) -> list[tuple[float, m.Message]]:
    out = []
    while True:
        message = peer.read()
        out.append((time.monotonic(), message))
        if isinstance(message, m.TaskComplete | m.ErrorMessage) and getattr(message, "task_id", None) == task_id:
            return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_request_beats_every_interval_until_its_end_and_never_after(model_dir: Path, stream: bool) -> None:
    interval = 0.1
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 heartbeat_interval_s=interval) as app:
        peer = RawPeer(app.socket)
        peer.send(request("warm", 1))  # a short request first: it armed the timer, which then found nothing to do
        peer.read_until_end("warm")
        time.sleep(3 * interval)
        app.engine.delay_s = 0.35  # each token stalls
        sent = time.monotonic()
        peer.send(request("long", 3, stream=stream))
        got = timed_until_end(peer, "long")
        app.engine.delay_s = 0
        beats = [at for at, message in got if isinstance(message, m.Heartbeat)]
        assert isinstance(got[-1][1], m.TaskComplete) and got[-1][1].usage.completion_tokens == 3
        assert len(beats) >= 3  # over a second of stalls
        assert all(message.task_id == "long" for _, message in got if isinstance(message, m.Heartbeat))
        assert beats[0] - sent >= 0.9 * interval  # not before an interval passed
        # The next request on the connection: no heartbeat of "long" comes after its TASK_COMPLETE.
        peer.send(request("after", 1))
        later = peer.read_until_end("after")
        assert [message for message in later if isinstance(message, m.Heartbeat)] == []
        peer.close()


def test_two_long_requests_in_flight_both_beat(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 heartbeat_interval_s=0.1) as app:
        app.engine.delay_s = 0.3
        peer = RawPeer(app.socket)
        peer.send(request("a", 3))
        peer.send(request("b", 3, stream=True))
        ended: set[str] = set()
        beats: dict[str, int] = {"a": 0, "b": 0}
        while len(ended) < 2:
            message = peer.read()
            if isinstance(message, m.Heartbeat):
                assert message.task_id not in ended
                beats[message.task_id] += 1
            elif isinstance(message, m.TaskComplete | m.ErrorMessage):
                assert isinstance(message, m.TaskComplete), message
                ended.add(message.task_id)
        app.engine.delay_s = 0
        assert beats["a"] >= 2 and beats["b"] >= 1, beats
        peer.close()


def test_short_requests_arm_no_heartbeat_timer_each(model_dir: Path) -> None:
    armed: list[str] = []
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 heartbeat_interval_s=60) as app:
        loop = app.loop
        call_at = loop.call_at

        def counting_call_at(when: float, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            name = getattr(callback, "__name__", "")
            if "beat" in name:  # the session's timer (_beat), or a per-request pump's
                armed.append(name)
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counting_call_at  # type: ignore[method-assign]
        peer = RawPeer(app.socket)
        for n in range(20):
            peer.send(request(f"t{n}", 1, stream=n % 2 == 1))
            assert isinstance(peer.read_until_end(f"t{n}")[-1], m.TaskComplete)
        peer.close()
        del loop.call_at  # type: ignore[method-assign]
    assert len(armed) <= 1, armed  # the connection's one timer, armed by the first request, not one per request
