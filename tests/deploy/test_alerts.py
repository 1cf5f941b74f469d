"""Every alert in deploy/monitoring/alerts.yml fires in one case and stays silent in another,
as Prometheus itself evaluates them: `promtool test rules` (Debian's `prometheus` package;
.ci/run installs it) over series written here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "alerts.yml"
ERROR = 'status="INTERNAL"'
OK = 'status="FINISH_REASON_EOS"'
REQUESTS = "specserve_gateway_requests_total"
MEMORY = 'namespace="specserve", container="verifier", pod="verifier-0"'

# alert -> (series of the firing case, its alert's own labels; series of the silent case),
# sampled every minute, evaluated at EVAL.
CASES: dict[str, tuple[dict[str, str], dict[str, str], dict[str, str]]] = {
    "SpecserveNoHealthyVerifier": (
        {'specserve_scheduler_live_members{kind="verifier"}': "0x30"},
        {},
        {'specserve_scheduler_live_members{kind="verifier"}': "1x30"},
    ),
    "SpecserveSchedulerMetricsAbsent": (
        {'up{namespace="specserve", pod="gateway-0"}': "1x30"},
        {},
        {'specserve_scheduler_live_members{kind="verifier"}': "0x30"},
    ),
    "SpecserveTargetDown": (
        {'up{namespace="specserve", pod="gateway-0"}': "0x30"},
        {"namespace": "specserve", "pod": "gateway-0"},
        {'up{namespace="specserve", pod="gateway-0"}': "1x30"},
    ),
    "SpecserveRedisUnreachable": (
        {'specserve_readiness_check_passing{check="redis reachable", pod="gateway-0"}': "0x30"},
        {"pod": "gateway-0"},
        {'specserve_readiness_check_passing{check="redis reachable", pod="gateway-0"}': "1x30"},
    ),
    "SpecserveNoDrafter": (
        {'specserve_scheduler_live_members{kind="drafter"}': "0x30"},
        {},
        {'specserve_scheduler_live_members{kind="drafter"}': "2x30"},
    ),
    "SpecserveMemoryHigh": (
        {
            f"container_memory_working_set_bytes{{{MEMORY}}}": "95x30",
            f"container_spec_memory_limit_bytes{{{MEMORY}}}": "100x30",
        },
        {"pod": "verifier-0"},
        {
            f"container_memory_working_set_bytes{{{MEMORY}}}": "50x30",
            f"container_spec_memory_limit_bytes{{{MEMORY}}}": "100x30",
        },
    ),
    "SpecserveKVBudgetFull": (
        {
            'specserve_verifier_kv_used_tokens{instance="v0"}': "990x30",
            'specserve_verifier_kv_budget_tokens{instance="v0"}': "1000x30",
        },
        {"instance": "v0"},
        {
            'specserve_verifier_kv_used_tokens{instance="v0"}': "500x30",
            'specserve_verifier_kv_budget_tokens{instance="v0"}': "1000x30",
        },
    ),
    "SpecserveErrorRateHigh": (
        {f"{REQUESTS}{{{ERROR}}}": "0+10x30", f"{REQUESTS}{{{OK}}}": "0+10x30"},
        {},
        {f"{REQUESTS}{{{ERROR}}}": "0+0x30", f"{REQUESTS}{{{OK}}}": "0+10x30"},
    ),
    "SpecserveTTFTHigh": (
        {
            f'specserve_gateway_ttft_seconds_bucket{{priority="interactive", le="{le}"}}': v
            for le, v in (("1", "0x30"), ("5", "0x30"), ("10", "0+10x30"), ("+Inf", "0+10x30"))
        },
        {},
        {
            f'specserve_gateway_ttft_seconds_bucket{{priority="interactive", le="{le}"}}': "0+10x30"
            for le in ("1", "5", "10", "+Inf")
        },
    ),
    "SpecserveAcceptanceCollapsed": (
        {
            "specserve_verifier_accepted_tokens_total": "0+1x30",
            "specserve_verifier_drafted_tokens_total": "0+100x30",
        },
        {},
        {
            "specserve_verifier_accepted_tokens_total": "0+60x30",
            "specserve_verifier_drafted_tokens_total": "0+100x30",
        },
    ),
    "SpecserveQueueGrowing": (
        {'specserve_scheduler_queue_depth{class="interactive"}': "0+5x30"},
        {},
        {'specserve_scheduler_queue_depth{class="interactive"}': "100x30"},
    ),
    "SpecserveCanaryFailsMore": (  # stable has had no error at all: the case a sum missed
        {
            f'{REQUESTS}{{pool="canary", {ERROR}}}': "0+1x30",
            f'{REQUESTS}{{pool="canary", {OK}}}': "0+9x30",
            f'{REQUESTS}{{pool="stable", {OK}}}': "0+10x30",
        },
        {},
        {
            f'{REQUESTS}{{pool="canary", {OK}}}': "0+10x30",
            f'{REQUESTS}{{pool="stable", {OK}}}': "0+10x30",
        },
    ),
}
EVAL = "30m"  # past every rule's `for` and range


def rules() -> dict[str, dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def test_every_alert_has_a_firing_and_a_silent_case():
    assert set(CASES) == set(rules())


def test_each_alert_fires_in_its_case_and_not_in_the_other(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    tests = []
    for name, (firing, labels, silent) in CASES.items():
        rule = rules()[name]
        expected = {
            "exp_labels": {**rule["labels"], **labels},
            "exp_annotations": rule["annotations"],
        }
        for series, alerts in ((firing, [expected]), (silent, [])):
            tests.append(
                {
                    "interval": "1m",
                    "input_series": [{"series": s, "values": v} for s, v in series.items()],
                    "alert_rule_test": [
                        {"eval_time": EVAL, "alertname": name, "exp_alerts": alerts}
                    ],
                }
            )
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "tests": tests}))
    run = subprocess.run(
        [promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
