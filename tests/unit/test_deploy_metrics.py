"""Every metric the dashboard and the alerts query exists in kvgate's or vLLM's /metrics.

kvgate's side is its live registry (`kvgate.metrics.KvgateMetrics`), vLLM's the real /metrics pages
in tests/data/. A metric renamed or not yet exported fails here, by name, instead of leaving
an empty panel or an alert that can never fire. Label matchers are checked too: a selector on a
label the metric does not carry matches nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from kvgate.metrics import KvgateMetrics, LoopCounter

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"
VLLM_PAGES = sorted((ROOT / "tests" / "data").glob("*metrics*.txt"))

# Labels Prometheus (target labels set by the Prometheus Operator) or PromQL add to every series.
TARGET_LABELS = {"namespace", "pod", "service", "container", "endpoint", "job", "instance"}
# The telemetry metrics (issue 4) the alerts and dashboard rely on, by the names agreed for them.
TELEMETRY = {
    "kvgate_backend_kv_usage_ratio",
    "kvgate_backend_running_requests",
    "kvgate_backend_waiting_requests",
    "kvgate_backend_preemptions_total",
    "kvgate_gpu_free_bytes",
    "kvgate_scrape_age_seconds",
    "kvgate_backend_restarts_total",
}

# ---------------------------------------------------------------------------------------------
# PromQL: the metric selectors of an expression
# ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<duration>\[[^\]]*\])
  | (?P<variable>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)
  | (?P<offset>(?<![A-Za-z0-9_:])(?:\d+(?:ms|[smhdwy]))+(?![A-Za-z0-9_:]))
  | (?P<number>(?<![A-Za-z_:])\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},])
  | (?P<space>\s+)
    """,
    re.VERBOSE,
)
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value}) for every vector selector in a PromQL expression."""
    tokens = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read PromQL at {expr[pos : pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))
    found = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "ident" and text in _KEYWORDS:
            if text in {"by", "without", "on", "ignoring", "group_left", "group_right"} and nxt == "(":
                i = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")")  # a label list
            i += 1
            continue
        if kind == "ident" and (nxt == "(" or (text in _AGGREGATIONS and nxt in {"by", "without"})):
            # a function or an aggregation
            i += 1
            continue
        if kind == "ident":
            labels: dict[str, str] = {}
            if nxt == "{":
                j = i + 2
                while tokens[j][1] != "}":
                    if tokens[j][0] == "ident":
                        labels[tokens[j][1]] = tokens[j + 2][1].strip("\"'`")
                        j += 3
                    else:
                        j += 1
                i = j
            found.append((text, labels))
        i += 1
    return found


def test_selectors_reads_promql() -> None:
    expr = (
        'sum by (namespace, reason) (rate(kvgate_decisions_total{decision="reject", pod=~"$pod"}[5m]))'
        " / ignoring (reason) group_left sum by (namespace) (rate(vllm:num_preemptions_total[$__rate_interval]))"
        ' > 0.05 and on (pod) histogram_quantile(0.95, sum by (le) (rate(x_bucket{le!="1"}[1h] offset 5m)))'
    )
    assert selectors(expr) == [
        ("kvgate_decisions_total", {"decision": "reject", "pod": "$pod"}),
        ("vllm:num_preemptions_total", {}),
        ("x_bucket", {"le": "1"}),
    ]


# ---------------------------------------------------------------------------------------------
# What the deployment queries, and what exists
# ---------------------------------------------------------------------------------------------


def alert_exprs() -> dict[str, str]:
    rule = yaml.safe_load((BASE / "prometheusrule.yaml").read_text())
    return {r.get("alert") or r["record"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def dashboard_exprs() -> dict[str, str]:
    dashboard = json.loads((BASE / "dashboards" / "kvgate.json").read_text())
    exprs = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs[f"{panel['title']} [{target['refId']}]"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.fullmatch(r"label_values\((.*), *[A-Za-z_]+\)", variable["definition"])
            assert inner, variable["definition"]
            exprs[f"variable {variable['name']}"] = inner.group(1)
    return exprs


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


def kvgate_series() -> dict[str, set[str]]:
    """Series name -> label names, from a fresh KvgateMetrics registry."""
    metrics = KvgateMetrics()
    # Label names of metrics that have no child yet (collect() shows no sample for them).
    objects = [
        *vars(metrics).values(),
        *(
            v
            for o in vars(metrics).values()
            if hasattr(o, "__dict__") and not isinstance(o, MetricWrapperBase)
            for v in vars(o).values()
        ),
    ]
    labels_of = {m._name: set(m._labelnames) for m in objects if isinstance(m, MetricWrapperBase)}
    labels_of.update({m.name: set(m.labelnames) for m in objects if isinstance(m, LoopCounter)})
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        labels = labels_of.get(family.name, set())
        for suffix in _SUFFIXES[family.type]:
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def vllm_series() -> dict[str, set[str]]:
    assert VLLM_PAGES, "the real vLLM /metrics pages are missing from tests/data/"
    series: dict[str, set[str]] = {}
    for page in VLLM_PAGES:
        for family in text_string_to_metric_families(page.read_text()):
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


KVGATE = kvgate_series()
VLLM = vllm_series()


def problems_in(exprs: dict[str, str]) -> list[str]:
    problems = []
    for where, expr in exprs.items():
        found = selectors(expr)
        assert found, f"{where}: no metric in {expr!r}"
        for name, labels in found:
            known = KVGATE.get(name) if name.startswith("kvgate_") else VLLM.get(name)
            if known is None:
                problems.append(f"{name} (used by {where}) is not exported")
                continue
            unknown = set(labels) - known - TARGET_LABELS
            if unknown:
                problems.append(f"{name} has no label {sorted(unknown)} (used by {where})")
    return sorted(set(problems))


def test_the_metric_sources_are_real() -> None:
    assert "kvgate_decisions_total" in KVGATE
    assert "le" in KVGATE["kvgate_queue_wait_seconds_bucket"]
    assert {"decision", "reason"} <= KVGATE["kvgate_decisions_total"]
    assert "gpu" in KVGATE.get("kvgate_gpu_free_bytes", set())
    assert "vllm:kv_cache_usage_perc" in VLLM
    assert "vllm:time_to_first_token_seconds_bucket" in VLLM
    assert "model_name" in VLLM["vllm:num_requests_running"]


def test_the_deployment_relies_on_the_telemetry_names_agreed() -> None:
    used = {name for expr in [*alert_exprs().values(), *dashboard_exprs().values()] for name, _ in selectors(expr)}
    assert used >= TELEMETRY


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_queried_exists(source: str) -> None:
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    assert problems_in(exprs) == []


def test_a_missing_metric_or_label_is_reported() -> None:
    """Negative control: the existence check is not vacuous."""
    assert problems_in({"x": "rate(kvgate_no_such_thing_total[5m])"}) == [
        "kvgate_no_such_thing_total (used by x) is not exported"
    ]
    assert problems_in({"y": 'kvgate_decisions_total{verdict="reject"}'}) == [
        "kvgate_decisions_total has no label ['verdict'] (used by y)"
    ]
    assert problems_in({"z": 'vllm:kv_cache_usage_perc{model_name="m", pod="p"}'}) == []
