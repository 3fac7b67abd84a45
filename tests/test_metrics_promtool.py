"""``GET /metrics`` passes ``promtool check metrics`` (Prometheus' own linter, from Debian's ``prometheus`` package
that ``scripts/setup.sh`` installs): a real appliance, after requests on every surface that fill every family with
samples (a family without one would hide its labels from the linter), has no problem to report but the colons of
the three vLLM-named gauges the inference gateway reads."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from harness import running
from prometheus_client.parser import text_string_to_metric_families

from appliance.http.metrics import VLLM_KV_USAGE, VLLM_RUNNING, VLLM_WAITING

PROMTOOL = "promtool"
VLLM_NAMES = (VLLM_WAITING, VLLM_RUNNING, VLLM_KV_USAGE)
ENGINE = {"adaptive": True, "threads": 1, "warmup_runs": 0, "adaptive_sample_rate": 1}
"""Every request sampled: the load-profile families have their percentiles after the first requests."""


def promtool() -> str:
    found = shutil.which(PROMTOOL)
    if found is None:
        pytest.fail("promtool is missing: run scripts/setup.sh, which installs Debian's prometheus package with "
                    "apt-get (or: apt-get install -y prometheus)")
    return found


def test_the_page_passes_promtool_check_metrics(tiny_model: Path, tiny_model_b: Path) -> None:
    tool = promtool()
    models = {"tiny": {"path": str(tiny_model)}, "tiny_b": {"path": str(tiny_model_b)}}
    with running(models, model_dirs=[tiny_model.parent, tiny_model_b.parent], engine=ENGINE,
                 disk_kv_budget="64MiB") as app:
        url = app.appliance.http_url
        app.line("REGISTER a tiny")
        assert app.line("DECODE a 3 Hello there").startswith("OK")
        chat = {"model": "tiny_b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "user": "b"}
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json={**chat, "model": "nope"}).status_code == 404
        page = httpx.get(url + "/metrics", timeout=60)
        assert page.status_code == 200
    empty = [family.name for family in text_string_to_metric_families(page.text) if not family.samples]
    assert empty == [], f"families without a sample (the linter would not see their labels): {empty}"
    checked = subprocess.run([tool, "check", "metrics"], input=page.text, capture_output=True, text=True,
                             timeout=60)
    # The one finding allowed: the colons of vLLM's names, which the inference gateway's endpoint picker reads by
    # default (legal in the exposition format; the linter keeps colons for recording rules).
    allowed = {f"{name} metric names should not contain ':'" for name in VLLM_NAMES}
    findings = {line for line in (checked.stdout + checked.stderr).splitlines() if line.strip()}
    assert findings == allowed and checked.returncode in (0, 3), \
        f"promtool check metrics (exit {checked.returncode}):\n{checked.stdout}{checked.stderr}"


def test_promtool_finds_the_problems_it_is_asked_about() -> None:
    """The check above can fail: the linter reports a ``quantile`` label on a gauge, the problem this page had."""
    page = "# HELP x_tokens Tokens.\n# TYPE x_tokens gauge\nx_tokens{quantile=\"0.5\"} 1\n"
    checked = subprocess.run([promtool(), "check", "metrics"], input=page, capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode != 0 and 'should not have "quantile" label' in checked.stdout + checked.stderr
