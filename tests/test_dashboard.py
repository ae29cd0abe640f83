"""The dashboard of a real replay: decision first, one look per policy in every figure, the recommendation rule,
bootstrap intervals, and (where a Chromium is installed) the page drawn in a headless browser."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvprof.commands.common import result_envelope
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import enumerate_variants, runnable_variants
from kvprof.policies.variants import ALL
from kvprof.replay.engine import run_replay
from kvprof.replay.setting import ReplaySettings
from kvprof.report import decision, replay
from kvprof.report.dashboard import dashboard_sections, write_dashboard
from kvprof.report.html import render_html
from kvprof.report.styles import DENSE, KNOWN, policy_style
from kvprof.report.uncertainty import Interval, proportion, ratio_of_sums
from kvprof.results.replay import ReplayResult
from kvprof.traces.trace import read_trace


@pytest.fixture(scope="module")
def replay_file(lora_trace, tmp_path_factory):
    """A replay result file: every policy the tiny lora world runs, two trajectories, online accuracy."""
    agents = load_agents_for_trace(lora_trace, device="cpu", dtype="float32")
    variants, skipped = runnable_variants(enumerate_variants([ALL]), Runtime(agents), skip=True)
    trajectories = read_trace(lora_trace).trajectories[:2]
    result = run_replay(agents, trajectories, variants, ReplaySettings(repeats=1, online=True))
    result.update(trace=str(lora_trace), trace_source="capture", skipped=skipped)
    path = tmp_path_factory.mktemp("replay") / "replay.json"
    path.write_text(json.dumps(result_envelope("replay", result, {"device": "cpu"})))
    return path


def _policy_traces(figure, labels):
    return [trace for trace in figure.data if trace.legendgroup in labels]


def _colour(trace) -> str:
    if trace.type == "box":
        return trace.line.color
    return trace.marker.color if trace.marker.color is not None else trace.line.color


def test_every_policy_keeps_one_colour_across_every_figure(replay_file):
    sections, _ = dashboard_sections([replay_file])
    result = json.loads(replay_file.read_text())
    labels = set(result["policies"]) | {DENSE}
    colours: dict[str, set[str]] = {}
    figures = [figure for section in sections for figure in section.figures]
    drawn = dict.fromkeys(labels, 0)
    for figure in figures:
        for trace in _policy_traces(figure, labels):
            colours.setdefault(trace.legendgroup, set()).add(_colour(trace))
            drawn[trace.legendgroup] += 1
    assert len(figures) >= 6 and all(count >= 5 for count in drawn.values()), drawn
    assert {label: len(found) for label, found in colours.items()} == dict.fromkeys(labels, 1)
    assert {label: found.pop() for label, found in colours.items()} == {
        label: policy_style(label).color for label in labels
    }
    looks = {(policy_style(label).color, policy_style(label).symbol) for label in labels}
    assert len(looks) == len(labels)  # no two policies look alike


def test_the_dense_run_is_drawn_once_per_figure_as_nonshared(replay_file):
    sections, _ = dashboard_sections([replay_file])
    for figure in (figure for section in sections for figure in section.figures):
        names = [trace.name for trace in figure.data]
        assert "dense" not in names and "dense (NonShared)" not in names
        per_panel: dict[tuple, list] = {}
        for trace in figure.data:
            per_panel.setdefault((trace.xaxis, trace.yaxis), []).append(trace.name)
        for panel in per_panel.values():
            assert len(panel) == len(set(panel)), panel


def test_page_opens_with_the_decision_and_links_every_section(replay_file):
    sections, environment = dashboard_sections([replay_file])
    page = render_html("kvprof report", sections[::-1], environment=environment)
    headings = [part.split("</h2>")[0] for part in page.split("<h2>")[1:]]
    assert headings[0].startswith("Decision: which policy")
    ids = [part.split('"')[0] for part in page.split('<section id="')[1:]]
    assert len(ids) == len(set(ids)) == len(sections)
    assert all(f'href="#{anchor}"' in page for anchor in ids)
    assert (
        environment.rows[0][3] == "float32" and environment.rows[0][5] == json.loads(replay_file.read_text())["kvprof"]
    )
    assert '<table class="env"><caption>environment</caption>' in page
    recommended = [line for line in sections[0].card if line.startswith("Recommended: ")]
    assert len(recommended) == 1 and sections[0].card[0].startswith("Target: ")


def _outcome(label, speed, accuracy, kl, memory=0.5, spread=0.05):
    return decision.Outcome(
        label=label,
        accuracy=Interval(accuracy, accuracy, accuracy, 10),
        kl=kl,
        ttft=Interval(speed, speed - spread, speed + spread, 10),
        tpot_ms=None,
        latency=Interval(speed, speed, speed, 10),
        memory=Interval(memory, memory, memory, 10),
    )


def test_recommendation_is_the_fastest_within_one_point_and_kl_breaks_ties():
    reference = _outcome(DENSE, 1.0, 1.0, 0.0, memory=1.0)
    inaccurate = _outcome("fullshared", 3.0, 0.5, 0.1)
    separate = [reference, inaccurate, _outcome("a", 2.0, 1.0, 1e-3), _outcome("b", 1.5, 1.0, 1e-6)]
    lines = decision.decide(separate).lines
    assert lines[1].startswith("Fastest: a ") and lines[-1].startswith("Recommended: a ")
    tied = [reference, inaccurate, _outcome("a", 2.0, 1.0, 1e-3), _outcome("b", 1.95, 1.0, 1e-6)]
    lines = decision.decide(tied).lines
    assert lines[1].startswith("Fastest: a ") and "KL breaks it" in lines[2] and lines[-1].startswith("Recommended: b ")
    same_kl = [reference, _outcome("a", 2.0, 1.0, 1e-3, memory=0.6), _outcome("b", 1.95, 1.0, 1.05e-3, memory=0.4)]
    lines = decision.decide(same_kl).lines
    assert "lowest memory" in lines[2] and lines[-1].startswith("Recommended: b ")
    one_point = [reference, _outcome("a", 2.0, 0.99, 1e-3), _outcome("b", 2.0, 0.98, 1e-3)]
    assert [o.label for o in decision.eligible(one_point)] == [DENSE, "a"]


def test_bootstrap_intervals():
    assert proportion(10, 10) == Interval(1.0, 1.0, 1.0, 10)
    half = proportion(5, 10)
    assert half.value == 0.5 and 0.1 <= half.low < 0.5 < half.high <= 0.9
    speed = ratio_of_sums([[2.0, 1.0], [4.0, 1.0], [3.0, 1.5]])
    assert speed.value == pytest.approx(9.0 / 3.5) and speed.low < speed.value < speed.high
    assert speed == ratio_of_sums([[2.0, 1.0], [4.0, 1.0], [3.0, 1.5]])  # seeded: deterministic
    assert ratio_of_sums([[2.0, 1.0]]) == Interval(2.0, 2.0, 2.0, 1)


def test_styles_are_fixed_per_label_and_distinct_per_policy():
    assert policy_style("kvcmas") == policy_style("kvcmas") and policy_style("kvcmas").color == KNOWN["kvcmas"][0]
    assert len({colour for colour, _, _ in KNOWN.values()}) == len(KNOWN)
    assert policy_style("cacheblend-r=0.1") != policy_style("cacheblend-r=0.15")
    for first, second in (("rebaseshared-lp", "rebaseshared-db"), ("baseshared-full", "baseshared-incremental")):
        a, b = policy_style(first), policy_style(second)
        assert a.dash != b.dash and a.color != b.color
    assert policy_style("baselrshared").dash != policy_style("prelrshared").dash  # curves that coincide on shared A
    unknown = policy_style("newpolicy-x")
    assert unknown == policy_style("newpolicy-x") and unknown.color.startswith("#")


def test_browser_draws_every_figure_without_console_errors(replay_file, tmp_path):
    browser = pytest.importorskip("kvprof.report.browser")
    pytest.importorskip("playwright")
    if browser.chromium_path() is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    sections, environment = dashboard_sections([replay_file])
    page = write_dashboard(tmp_path / "report.html", sections, [replay_file], environment)
    screenshot = tmp_path / "decision.png"
    check = browser.open_page(page, {"section": screenshot})
    assert check.errors == []
    assert len(check.figures) == sum(len(section.figures) for section in sections)
    assert check.undrawn == []
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decision_without_online_accuracy_or_a_nonshared_rerun(replay_file):
    result = json.loads(replay_file.read_text())
    del result["online"], result["policies"][DENSE]
    result = ReplayResult.from_json(result, str(replay_file))
    section = replay.decision_section(result)
    assert section.card[0].startswith("Target: the fastest TTFT (this replay ran without --online")
    reference = decision.outcomes(result)[0]
    assert reference.label == DENSE and reference.ttft == Interval(1.0, 1.0, 1.0, reference.ttft.n)
    pareto, bars, _ = section.figures
    assert len(pareto.data) == len(result.policies) + 1  # the KL panel only, one marker per label
    assert {trace.legendgroup for trace in bars.data} == set(result.policies) | {DENSE}


def test_browser_on_the_report_named_in_kvprof_report(tmp_path):
    """`KVPROF_REPORT=runs/demo/report.html pytest tests/test_dashboard.py -k browser` checks the demo's report."""
    named = os.environ.get("KVPROF_REPORT")
    if not named:
        pytest.skip("KVPROF_REPORT names no report")
    browser = pytest.importorskip("kvprof.report.browser")
    pytest.importorskip("playwright")
    if browser.chromium_path() is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    page = Path(named)
    check = browser.open_page(page, {"section": tmp_path / "decision.png"})
    assert check.errors == [] and check.undrawn == []
    assert len(check.figures) == page.read_text(encoding="utf-8").count("Plotly.newPlot") > 0
    assert (tmp_path / "decision.png").stat().st_size > 0


def test_browser_check_reports_errors_and_undrawn_figures(tmp_path):
    browser = pytest.importorskip("kvprof.report.browser")
    pytest.importorskip("playwright")
    if browser.chromium_path() is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    page = tmp_path / "broken.html"
    page.write_text("<html><body><div id='fig-0'></div><script>console.error('boom'); undefinedCall();</script>")
    check = browser.open_page(page, timeout_ms=500)
    assert check.undrawn == ["fig-0"]
    assert check.errors[0] == "boom" and "undefinedCall" in check.errors[1]
