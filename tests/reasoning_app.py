"""An appliance on real reasoning templates (Qwen3, DeepSeek R1) driven by a fake engine whose replies a test
writes: the surfaces' reasoning tests share it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import Running, running

from appliance.config.validate import Config
from appliance.engine.fake import FakeEngine
from appliance.engine.interface import Sampling

R1_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
R1_REPLY = "The sky scatters blue light more.\n</think>\n\nRayleigh scattering."
QWEN3_REPLY = "<think>\nShort wavelengths scatter.\n</think>\n\nRayleigh scattering."


def fake_engine(config: Config) -> FakeEngine:
    return FakeEngine()


@contextmanager
def reasoning_app(chat_model: Callable[..., Path]) -> Iterator[Running]:
    """Models ``r1``, ``qwen3`` and ``r1-inline`` (``reasoning: inline``) on a :class:`FakeEngine`."""
    qwen3 = chat_model("qwen2", "Qwen-Qwen3-0.6B")
    r1 = chat_model("llama-bpe", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", R1_TOKENS)
    models = {"r1": {"path": str(r1)}, "qwen3": {"path": str(qwen3)},
              "r1-inline": {"path": str(r1), "reasoning": "inline"}}
    with running(models, model_dirs=[r1.parent], engine_factory=fake_engine) as app:
        yield app


def reply_with(app: Running, text: str) -> None:
    """Every generation of ``app``'s fake engine writes ``text``."""
    def script(sampling: Sampling) -> str:
        return text

    app.engine.script = script
