"""The reuse structure of a trajectory (kvprof.traces.reuse) against brute force, and the divergence causes on traces
shaped as chat templates render them."""

from __future__ import annotations

import json
import random

import pytest

from kvprof.traces.reuse import (
    MIN_SPAN,
    MovedSpan,
    PrefixTree,
    ReuseSummary,
    SpanIndex,
    SpanMatching,
    align_span,
    common_prefix,
    divergence_cause,
    trajectory_reuse,
)
from kvprof.traces.trace import Segment, Trajectory, Turn

IDS = SpanMatching(boundaries="ids")  # moved spans as runs of ids: these trajectories hold one message per turn


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def trajectory(turns: list[tuple[str, list[int], list[int]]]) -> Trajectory:
    """A trajectory whose turn i reads one input segment and writes one output segment."""
    segments, rows = {}, []
    for i, (agent, ids, out) in enumerate(turns):
        segments[f"in:{i}"] = Segment("message", "shared", ids, "")
        segments[f"out:{i}"] = Segment("output", "shared", out, "", producer=agent)
        rows.append(Turn(agent, [f"in:{i}"], f"out:{i}"))
    return Trajectory("t", segments, rows)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200, 1000])
def test_common_prefix_finds_the_first_difference(n):
    a = list(range(1000))
    b = a[:n] + [-1] + a[n + 1 :]
    assert common_prefix(a, 0, b, 0, 1000) == n
    assert common_prefix(a, 3, a, 3, 500) == 500


def test_prefix_tree_matches_brute_force_on_branching_sequences():
    rng = random.Random(0)
    tree, sequences = PrefixTree(), []
    for turn in range(300):
        if sequences and rng.random() < 0.8:  # extend or branch from an earlier sequence
            base = rng.choice(sequences)
            ids = base[: rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(0, 30))]
        else:
            ids = [rng.randint(0, 5) for _ in range(rng.randint(0, 40))]
        best = max((lcp(ids, seq) for seq in sequences), default=0)
        match = tree.match(ids)
        assert match.length == best
        if best:
            assert lcp(ids, match.sequence) == best
        assert tree.insert(turn, ids) == best
        sequences.append(ids)


def test_span_index_finds_runs_elsewhere():
    index = SpanIndex()
    earlier = list(range(100, 160))
    index.add(earlier)
    ids = [1, 2, 3] + earlier[10:40] + [7] * 5 + earlier[:5]
    assert [(span.begin, span.end, span.source_begin) for span in index.find(ids, 0)] == [(3, 33, 10)]
    assert index.find(ids, 0, min_span=31) == []


def test_moved_spans_align_to_the_messages_of_reader_and_source():
    """A run of equal ids that starts in a header both sides share is trimmed to the messages: it begins and ends
    where a message of the reader, or of the source at the same offset, begins or ends."""
    header, question, reply = list(range(1000, 1007)), list(range(100, 140)), list(range(200, 230))
    source = Trajectory(
        "t",
        {
            "a:head": Segment("message", "shared", [1, 2, 3, *header], ""),
            "q": Segment("message", "shared", question, ""),
            "a:out": Segment("output", "shared", reply, "", producer="a"),
            "b:head": Segment("message", "shared", [4, 5, *header], ""),
            "b:out": Segment("output", "shared", [8], "", producer="b"),
        },
        [Turn("a", ["a:head", "q"], "a:out"), Turn("b", ["b:head", "q"], "b:out")],
    )
    ids_only = trajectory_reuse(source, IDS)
    assert ids_only[1].moved == len(header) + len(question)  # the header ids both share run into the question
    aligned = trajectory_reuse(source)
    assert aligned[1].moved == len(question) and aligned[1].new == 2 + len(header)
    span = MovedSpan(2, 49, source=0, source_begin=3)
    assert align_span(span, frozenset({0, 9, 49}), frozenset({0, 10, 50}), 16) == MovedSpan(9, 49, 0, 10)
    # a reply read under another header: its content starts a message in the source (its output) only
    assert align_span(span, frozenset({0}), frozenset({0, 5, 40}), 16) == MovedSpan(4, 39, 0, 5)
    assert align_span(span, frozenset({0, 60}), frozenset({0, 70}), 16) is None  # inside one message on both sides
    assert align_span(span, frozenset({0, 9, 20}), frozenset({0, 10, 21}), 16) is None  # shorter than 16


def test_growing_timeline_reuses_every_earlier_token():
    q, out0, cue, out1 = [1] * 20, [2] * 5, [3] * 4, [4] * 6
    rows = trajectory_reuse(
        trajectory([("plan", q, out0), ("act", q + out0 + cue, out1), ("plan", q + out0 + cue + out1, [5])])
    )
    assert [r.shared_prefix for r in rows] == [0, 25, 35]
    assert [r.own_prefix for r in rows] == [0, 0, 25]
    assert [r.new for r in rows] == [20, 4, 0]
    assert all(r.divergence is None for r in rows)
    assert rows[1].source == 0 and rows[2].source == 1


def test_divergence_causes():
    header = list(range(1000, 1010))
    question = list(range(100, 140))
    reply = list(range(200, 230))
    # a reply read back re-rendered: its first id trimmed away (Llama's `| trim`)
    rows = trajectory_reuse(
        trajectory([("a", header + question, reply), ("b", header + question + reply[1:] + [9] * 3, [8])]), IDS
    )
    assert rows[1].divergence.cause == "re-rendered reply" and rows[1].divergence.position == 50
    assert rows[1].moved == len(reply) - 1  # the rest of the reply is a span seen elsewhere
    # two ids of the earlier input became one (a merged "\n\n")
    merged = question[:20] + [7777] + question[22:]
    rows = trajectory_reuse(trajectory([("a", header + question, reply), ("b", header + merged, [8])]), IDS)
    assert rows[1].divergence.cause == "merged token" and rows[1].divergence.position == 30
    # the same message under another role header (AutoGen: another agent's reply arrives as `user`)
    rows = trajectory_reuse(
        trajectory([("a", header + [1, 2, 3] + question, reply), ("b", header + [4, 5] + question, [8])]), IDS
    )
    assert rows[1].divergence.cause == "different header"
    assert rows[1].shared_prefix == 10 and rows[1].moved == len(question) and rows[1].new == 2
    rows = trajectory_reuse(trajectory([("a", header + question, reply), ("b", header + list(range(500, 560)), [8])]))
    assert rows[1].divergence.cause == "different content" and rows[1].moved == 0


def test_divergence_cause_prefers_merged_token_in_a_reply():
    earlier = list(range(60))
    ids = earlier[:45] + [999] + earlier[47:]
    assert divergence_cause(ids, earlier, 45, earlier_input=40) == "merged token"
    assert divergence_cause(earlier[:45] + [999] * 20, earlier, 45, earlier_input=40) == "re-rendered reply"


def test_summary_counts_every_input_token_once():
    rng = random.Random(1)
    turns, context = [], []
    for i in range(30):
        context = context[: rng.randint(0, len(context))] + [rng.randint(0, 50) for _ in range(rng.randint(1, 40))]
        turns.append((f"agent{i % 3}", list(context), [rng.randint(0, 50) for _ in range(5)]))
    rows = trajectory_reuse(trajectory(turns), IDS)
    summary = ReuseSummary()
    summary.add(rows)
    assert summary.shared_prefix + summary.moved + summary.new == summary.input_tokens
    assert all(r.own_prefix <= r.shared_prefix for r in rows)
    assert all(r.moved == 0 or r.moved >= MIN_SPAN for r in rows)


def test_replay_prefills_what_the_reuse_structure_leaves_new(tiny_world, lora_trace):
    """On a trace whose turns extend one timeline, NonShared prefills what the agent's own prefix leaves and
    FullShared what the shared prefix and the moved spans leave (the tiny model's outputs repeat runs of ids; each
    policy computes at least one token of its input)."""
    from kvprof.model.agents import load_agents_for_trace
    from kvprof.policies import PolicyVariant
    from kvprof.replay.branches import plan_of
    from kvprof.replay.lockstep import replay_trace
    from kvprof.traces.trace import read_trace

    trajectories = read_trace(lora_trace).trajectories[:2]
    agents = load_agents_for_trace(lora_trace, device="cpu", dtype="float32")
    result = replay_trace(agents, trajectories, [PolicyVariant("fullshared"), PolicyVariant("nonshared")])
    rows = [row for traj in trajectories for row in trajectory_reuse(traj)]
    expected = {
        "nonshared": [row.input_tokens - min(row.own_prefix, row.input_tokens - 1) for row in rows],
        "fullshared": [
            start.tokens - start.reusable_prefix - start.moved_tokens
            for traj in trajectories
            for start in plan_of(traj, {})
        ],
    }
    for label, prefilled in expected.items():
        assert [turn["prefilled"] for turn in result["policies"][label]["turns"]] == prefilled
    assert sum(expected["fullshared"]) < sum(expected["nonshared"])


def test_inspect_prints_and_writes_the_reuse_structure(lora_trace, run_cli, tmp_path):
    code, out, err = run_cli("inspect", str(lora_trace), "--out", str(tmp_path))
    assert code == 0, err
    assert "reuse structure" in out and "shared prefix" in out
    result = json.loads((tmp_path / "inspect.json").read_text())
    total = result["total"]
    assert result["schema"] == "kvprof.result.inspect"
    assert total["shared_prefix"] + total["moved"] + total["new"] == total["input_tokens"] > 0
    turns = [turn for traj in result["trajectories"].values() for turn in traj["turns"]]
    assert len(turns) == total["turns"] and sum(t["new"] for t in turns) == total["new"]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_engine_hits_match_a_brute_force_prefix_cache(block_size):
    """A serving engine's hits: the longest prefix of the prompt among the computed ids of earlier turns in the same
    scope (inputs and generated ids but the last), short of the prompt's last id, in whole blocks."""
    rng = random.Random(block_size)
    turns, context = [], []
    for i in range(40):
        context = context[: rng.randint(0, len(context))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 30))]
        output = [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
        turns.append((f"agent{i % 3}", list(context), output))
        context = context + output
    rows = trajectory_reuse(trajectory(turns), block_size=block_size)

    def hits(index: int, scope: str | None) -> int:
        ids = turns[index][1]
        computed = [t[1] + t[2][:-1] for t in turns[:index] if scope is None or t[0] == scope]
        best = max((lcp(ids, seq) for seq in computed), default=0)
        return min(best, len(ids) - 1) // block_size * block_size

    for index, row in enumerate(rows):
        assert (row.engine_own, row.engine_shared) == (hits(index, turns[index][0]), hits(index, None))
        assert row.engine_own <= row.own_prefix and row.engine_shared <= row.shared_prefix
