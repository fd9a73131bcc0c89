"""Checks a Grafana dashboard's PromQL against the metrics a server exports (tests/ and e2e/
share it; pytest puts this folder on the path).

A dashboard that names a metric the server does not export (a renamed metric, a counter without
its `_total`) shows an empty panel and no error, so each query's metric names and the labels it
groups or filters by are checked against an exposition: the text `/metrics` serves."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana_dashboard.json"

# PromQL words that look like metric names: keywords and label-list modifiers.
KEYWORDS = frozenset(
    {
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
        "Inf",
        "NaN",
    }
)
# The sample names each metric type exposes (prometheus_client's text format).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


@dataclass
class Exposition:
    """What a /metrics text exports: every sample name (with the types' implied names, so a
    metric with no sample yet still counts), and the label names seen on each."""

    names: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Exposition":
        exposition = cls()
        for family in text_string_to_metric_families(text):
            for suffix in SUFFIXES.get(family.type, ("",)):
                exposition.names.add(family.name + suffix)
            for sample in family.samples:
                exposition.names.add(sample.name)
                exposition.labels.setdefault(sample.name, set()).update(sample.labels)
        return exposition


def _strip(expr: str) -> str:
    """The expression without strings, range selectors, label matchers and Grafana variables:
    what is left names metrics, functions and keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = _LABEL_LIST.sub(" ", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    return re.sub(r"\$\{?\w+\}?", "", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    stripped, names = _strip(expr), set()
    for found in _IDENTIFIER.finditer(stripped):
        before = stripped[found.start() - 1] if found.start() else " "
        if before.isdigit() or before == ".":
            continue  # an exponent or a duration unit (1e3, 5m)
        if stripped[found.end() :].lstrip().startswith("(") or found.group() in KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(found.group())
    return names


def label_names(expr: str, legend: str = "") -> set[str]:
    """Labels an expression groups or filters by, and those its legend shows."""
    labels = set()
    for listed in _LABEL_LIST.findall(expr):
        labels.update(name.strip() for name in listed.split(",") if name.strip())
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for matchers in re.findall(r"\{([^}]*)\}", no_strings):
        labels.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    labels.update(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))
    return labels


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target, rows' nested panels included."""
    found = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", ()):
                if "expr" in target:
                    found.append((panel.get("title", "?"), target["expr"], target.get("legendFormat", "")))
            walk(panel.get("panels", ()))

    walk(dashboard.get("panels", ()))
    return found


def problems(dashboard: dict, exposition: Exposition) -> list[str]:
    """Each query's metric names that the exposition lacks, and labels that none of its metrics
    carries (checked where those metrics have samples to show their labels); [] when it all
    exists."""
    out = []
    for title, expr, legend in queries(dashboard):
        names = metric_names(expr)
        if not names:
            out.append(f"{title!r}: {expr!r} selects no metric")
        for name in sorted(names - exposition.names):
            out.append(f"{title!r}: {name} is not exported ({expr!r})")
        sampled = [exposition.labels[n] for n in names if n in exposition.labels]
        if sampled:
            known = set().union(*sampled)
            for label in sorted(label_names(expr, legend) - known):
                out.append(f"{title!r}: no metric of {expr!r} has the label {label!r}")
    return out


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())
