"""The alert rules, the Grafana dashboard and docs/metrics.md against the metrics
the collectors really export; the rules' behaviour under promtool (when installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.cluster.state import NodeInfo, NodeRole
from common.metrics.gc import GcCollector
from common.metrics.node import NodeCollector
from common.metrics.server import make_registry
from common.metrics.steps import StepHistograms
from common.runtime.gc_heap import GcPauses
from decode_node.worker import DecodeStats
from pdserve.supervisor import Health, Role, Watch
from pdserve.supervisor_metrics import SupervisorCollector
from prefill_node.worker import PrefillStats
from router.metrics import RouterCollector
from tests.unit.common.test_metrics import engine_stats, node_info, router_state

REPO = Path(__file__).resolve().parents[3]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "pdserve-dashboard.json"
DOC = REPO / "docs" / "metrics.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)"
)


def expositions() -> dict[str, str]:
    """What a router, a prefill node and a decode node expose (fake state, every metric)."""
    heartbeat = SimpleNamespace(published=1, consecutive_failures=0, failures=0)
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    prefill = PrefillStats()
    prefill.transferred(4096, 0.01)
    decode = DecodeStats()
    decode_info = NodeInfo("d-1", NodeRole.DECODE, "127.0.0.1:2", "smol", 16)
    routing, stats = router_state()
    stats.routed("d-1", "p-1")
    # What `pdserve up`'s supervisor knows: watches, read at scrape time.
    supervisor = SimpleNamespace(
        watches={
            "decode-0": Watch("decode-0", Role.DECODE, Health.SERVING, restarts=2),
            "prefill-0": Watch("prefill-0", Role.PREFILL, Health.GIVEN_UP, restarts=5),
        }
    )
    collectors = {
        "supervisor": SupervisorCollector(supervisor),
        "router": RouterCollector(routing),
        # As run_node builds them (common/runtime/node.py): with the engine's step histograms.
        "prefill": NodeCollector(
            node_info(), engine, heartbeat, prefill.counters, prefill.histograms, StepHistograms()
        ),
        "decode": NodeCollector(
            decode_info, engine, heartbeat, decode.counters, decode.histograms, StepHistograms()
        ),
        "gc": GcCollector(GcPauses(), {"role": "decode", "node": "d-1"}),
    }
    return {k: generate_latest(make_registry([c])).decode() for k, c in collectors.items()}


def exported() -> tuple[set[str], set[str]]:
    """(family names as documented: counters with _total, sample names)."""
    families, samples = set(), set()
    for text in expositions().values():
        for f in text_string_to_metric_families(text):
            families.add(f.name + "_total" if f.type == "counter" else f.name)
            samples.update(s.name for s in f.samples)
    return families, samples


def referenced(text: str) -> set[str]:
    return set(re.findall(r"\bpdserve_[a-z0-9_]+", text))


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_metric_names_follow_conventions():
    families, _ = exported()
    for name in families:
        assert name.startswith("pdserve_"), name
        assert not re.search(r"_(ms|us|milliseconds|kib|mib)(_|$)", name), name
    for text in expositions().values():
        for f in text_string_to_metric_families(text):
            if f.type == "counter":
                assert all(s.name.endswith("_total") for s in f.samples), f.name
            if f.type == "histogram":
                # A unit in the name: time, bandwidth, or tokens (a step's size).
                assert f.name.endswith(("_seconds", "_bytes_per_second", "_tokens")), f.name


def test_every_metric_is_documented():
    families, _ = exported()
    doc = DOC.read_text()
    missing = sorted(n for n in families if f"`{n}`" not in doc)
    assert not missing, f"add to docs/metrics.md: {missing}"
    _, samples = exported()
    unknown = sorted(referenced(doc) - families - samples)
    assert not unknown, f"docs/metrics.md names metrics nobody exports: {unknown}"


def test_alerts_use_exported_metrics_and_are_documented():
    _, samples = exported()
    doc = DOC.read_text()
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for r in rules:
        unknown = referenced(r["expr"]) - samples
        assert not unknown, (r["alert"], unknown)
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert f"`{r['alert']}`" in doc, f"{r['alert']} is not in docs/metrics.md"


def test_dashboard_queries_use_exported_metrics():
    _, samples = exported()
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert panels
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            unknown = referenced(t["expr"]) - samples
            assert not unknown, (p["title"], unknown)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "node"} <= variables


# ------------------------------------------------------------------ promtool
@needs_promtool
def test_promtool_accepts_rules_and_expositions(tmp_path):
    subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], check=True, capture_output=True)
    for role, text in expositions().items():
        lint = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=text, text=True, capture_output=True
        )
        assert lint.returncode == 0, (role, lint.stdout, lint.stderr)


# Each case: input series, then which alerts must (and must not) fire when.
# Labels of a node series: instance, job, role, node (as a scrape adds them).
D0 = 'instance="d0:1",job="pdserve-decode",role="decode",node="decode-0"'
D1 = 'instance="d1:1",job="pdserve-decode",role="decode",node="decode-1"'
ROUTER = 'instance="r:1",job="pdserve-router"'
SUP = 'instance="s:1",job="pdserve-supervisor"'
ALERT_TESTS = f"""
evaluation_interval: 15s
tests:
  # Leaked blocks: decode-0 is idle (no request for 10 min) yet holds 3 blocks;
  # decode-1 holds 30 but is busy.
  - interval: 30s
    input_series:
      - {{series: 'pdserve_kv_blocks{{{D0},state="used"}}', values: '3x40'}}
      - {{series: 'pdserve_requests_running{{{D0}}}', values: '0x40'}}
      - {{series: 'pdserve_requests_waiting{{{D0}}}', values: '0x40'}}
      - {{series: 'pdserve_requests_reserved{{{D0}}}', values: '0x40'}}
      - {{series: 'pdserve_node_requests_total{{{D0}}}', values: '7x40'}}
      - {{series: 'pdserve_kv_blocks{{{D1},state="used"}}', values: '30x40'}}
      - {{series: 'pdserve_requests_running{{{D1}}}', values: '2x40'}}
      - {{series: 'pdserve_requests_waiting{{{D1}}}', values: '0x40'}}
      - {{series: 'pdserve_requests_reserved{{{D1}}}', values: '0x40'}}
      - {{series: 'pdserve_node_requests_total{{{D1}}}', values: '0+1x40'}}
    alert_rule_test:
      - {{eval_time: 3m, alertname: PdserveKVBlocksLeakedAtIdle, exp_alerts: []}}
      - eval_time: 10m
        alertname: PdserveKVBlocksLeakedAtIdle
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "d0:1", job: pdserve-decode,
                         role: decode, node: decode-0, state: used}}
  # KV nearly exhausted on decode-0 (3 of 100 free or cached), not on decode-1.
  - interval: 1m
    input_series:
      - {{series: 'pdserve_kv_blocks{{{D0},state="free"}}', values: '2x10'}}
      - {{series: 'pdserve_kv_blocks{{{D0},state="cached"}}', values: '1x10'}}
      - {{series: 'pdserve_kv_blocks_capacity{{{D0}}}', values: '100x10'}}
      - {{series: 'pdserve_kv_blocks{{{D1},state="free"}}', values: '50x10'}}
      - {{series: 'pdserve_kv_blocks{{{D1},state="cached"}}', values: '0x10'}}
      - {{series: 'pdserve_kv_blocks_capacity{{{D1}}}', values: '100x10'}}
    alert_rule_test:
      - eval_time: 6m
        alertname: PdserveKVBlocksNearlyExhausted
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "d0:1", job: pdserve-decode,
                         role: decode, node: decode-0}}
  # 1 failure a second against 10 successes: over 5 %.
  - interval: 1m
    input_series:
      - {{series: 'pdserve_router_requests_total{{{ROUTER},status="OK"}}', values: '0+600x15'}}
      - {{series: 'pdserve_router_requests_total{{{ROUTER},status="UNAVAILABLE"}}', values: '0+60x15'}}
    alert_rule_test:
      - eval_time: 10m
        alertname: PdserveHighErrorRate
        exp_alerts: [{{exp_labels: {{severity: critical}}}}]
  # Clients cancelling and sending invalid requests is not a server error.
  - interval: 1m
    input_series:
      - {{series: 'pdserve_router_requests_total{{{ROUTER},status="OK"}}', values: '0+600x15'}}
      - {{series: 'pdserve_router_requests_total{{{ROUTER},status="CANCELLED"}}', values: '0+300x15'}}
      - {{series: 'pdserve_router_requests_total{{{ROUTER},status="INVALID_ARGUMENT"}}', values: '0+300x15'}}
    alert_rule_test:
      - {{eval_time: 10m, alertname: PdserveHighErrorRate, exp_alerts: []}}
  # Every first token between 2.5 and 5 s: p99 over 2 s.
  - interval: 1m
    input_series:
      - {{series: 'pdserve_router_time_to_first_token_seconds_bucket{{{ROUTER},le="2.5"}}', values: '0x20'}}
      - {{series: 'pdserve_router_time_to_first_token_seconds_bucket{{{ROUTER},le="5"}}', values: '0+60x20'}}
      - {{series: 'pdserve_router_time_to_first_token_seconds_bucket{{{ROUTER},le="+Inf"}}', values: '0+60x20'}}
    alert_rule_test:
      - {{eval_time: 5m, alertname: PdserveHighTimeToFirstToken, exp_alerts: []}}
      - eval_time: 15m
        alertname: PdserveHighTimeToFirstToken
        exp_alerts: [{{exp_labels: {{severity: warning}}}}]
  # decode-0 stopped heartbeating, decode-1 did not; no prefill node at all;
  # decode-1's engine died; the router cannot read Redis.
  - interval: 15s
    input_series:
      - {{series: 'pdserve_heartbeats_total{{{D0}}}', values: '100x20'}}
      - {{series: 'pdserve_heartbeats_total{{{D1}}}', values: '0+30x20'}}
      - {{series: 'pdserve_heartbeat_consecutive_failures{{{D1}}}', values: '0x20'}}
      - {{series: 'pdserve_node_info{{{D0},model="m",block_size="16"}}', values: '1x20'}}
      - {{series: 'pdserve_engine_alive{{{D1}}}', values: '1 1 0x18'}}
      - {{series: 'pdserve_redis_errors_total{{{ROUTER},op="route"}}', values: '0+5x20'}}
      - {{series: 'up{{instance="d0:1",job="pdserve-decode"}}', values: '1 1 0x18'}}
    alert_rule_test:
      - eval_time: 4m
        alertname: PdserveNodeNotHeartbeating
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "d0:1", job: pdserve-decode,
                         role: decode, node: decode-0}}
      - eval_time: 4m
        alertname: PdserveNoNodesOfARole
        exp_alerts: [{{exp_labels: {{severity: critical, role: prefill}}}}]
      - eval_time: 4m
        alertname: PdserveEngineDead
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "d1:1", job: pdserve-decode,
                         role: decode, node: decode-1}}
      - eval_time: 4m
        alertname: PdserveRouterCannotReadRedis
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "r:1", job: pdserve-router, op: route}}
      - eval_time: 4m
        alertname: PdserveTargetDown
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "d0:1", job: pdserve-decode}}
  # pdserve up restarted decode-0 three times in three minutes, decode-1 never;
  # it gave up on prefill-1.
  - interval: 1m
    input_series:
      - {{series: 'pdserve_supervisor_restarts_total{{{SUP},component="decode-0"}}', values: '0 1 2 3x10'}}
      - {{series: 'pdserve_supervisor_restarts_total{{{SUP},component="decode-1"}}', values: '0x12'}}
      - {{series: 'pdserve_supervisor_given_up{{{SUP},component="prefill-1"}}', values: '0 0 1x10'}}
      - {{series: 'pdserve_supervisor_given_up{{{SUP},component="decode-0"}}', values: '0x12'}}
    alert_rule_test:
      - {{eval_time: 1m, alertname: PdserveComponentCrashLooping, exp_alerts: []}}
      - eval_time: 4m
        alertname: PdserveComponentCrashLooping
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "s:1", job: pdserve-supervisor,
                         component: decode-0}}
      - eval_time: 3m
        alertname: PdserveComponentGivenUp
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "s:1", job: pdserve-supervisor,
                         component: prefill-1}}
  # Two preemptions a second for 10 minutes; one checksum mismatch.
  - interval: 1m
    input_series:
      - {{series: 'pdserve_preemptions_total{{{D0}}}', values: '0+120x20'}}
      - {{series: 'pdserve_kv_checksum_mismatches_total{{{D1}}}', values: '0 0 1x10'}}
    alert_rule_test:
      - eval_time: 16m
        alertname: PdservePreemptionStorm
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "d0:1", job: pdserve-decode,
                         role: decode, node: decode-0}}
      - eval_time: 3m
        alertname: PdserveKVChecksumMismatch
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "d1:1", job: pdserve-decode,
                         role: decode, node: decode-1}}
"""


@needs_promtool
def test_alerts_fire_when_they_should(tmp_path):
    # promtool compares annotations too; the cases test expressions and labels.
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    cases = yaml.safe_load(ALERT_TESTS)
    cases["rule_files"] = ["rules.yaml"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(cases))
    run = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
