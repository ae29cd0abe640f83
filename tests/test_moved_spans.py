"""Span-by-span execution (`kvprof.policies.moved`): a turn run as its kept prefix, new tokens and moved spans whose
K/V are inserted re-aligned equals the model's forward over the whole input when those K/V are the dense run's."""

from __future__ import annotations

import torch

from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies.moved import KeptSequence, SpanStore, extend_over_moved
from kvprof.traces.reuse import MovedSpan
from kvprof.traces.trace import read_trace


def test_a_turn_run_span_by_span_over_dense_moved_kv_is_the_full_forward(prompt_trace):
    agents = load_agents_for_trace(prompt_trace, device="cpu", dtype="float32")
    runtime = Runtime(agents)
    traj = read_trace(prompt_trace).trajectories[0]
    runtime.serve_trajectory(traj)
    turn = max(traj.turns, key=lambda turn: len(traj.input_tokens(turn)))
    ids = traj.input_tokens(turn)
    prefix = len(runtime.prefix(turn.agent))
    shared = ids[prefix:]
    assert len(shared) > 40
    with torch.inference_mode():
        dense = runtime.forward(turn.agent, ids, runtime.cache_from(runtime.empty_kv()), 0)
        dense_kv = runtime.kv_of(dense.cache)
        # two moved spans, each kept by a "source turn" that computed it at other positions (one earlier, one later)
        spans = [MovedSpan(8, 20, source=0, source_begin=3), MovedSpan(26, len(shared) - 5, source=1, source_begin=40)]
        store = SpanStore()
        for span in spans:
            begin, end = prefix + span.begin, prefix + span.end
            shift = prefix + span.begin - span.source_begin  # the reader's position − the source's, prefix 0
            kv = runtime.ropes.rotate_kv([(k[:, :, begin:end], v[:, :, begin:end]) for k, v in dense_kv], -shift)
            store.turns[span.source] = KeptSequence(span.source_begin, span.source_begin + len(span), 0, kv)
        reused = 4
        cache = runtime.cache_from([(k[:, :, : prefix + reused], v[:, :, : prefix + reused]) for k, v in dense_kv])
        done = extend_over_moved(runtime, turn.agent, shared, cache, reused, spans, store)
        assert done.moved == sum(len(span) for span in spans) and done.covered == spans[-1].end - reused
        assert done.computed == (8 - reused) + (26 - 20)
        chunk = shared[spans[-1].end :]
        last = runtime.forward(turn.agent, chunk, cache, prefix + spans[-1].end)
    torch.testing.assert_close(last.logits[0, -1], dense.logits[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last.logits[0], dense.logits[0, -len(chunk) :], atol=1e-4, rtol=1e-4)
    for (keys, values), (dense_keys, dense_values) in zip(runtime.kv_of(last.cache), dense_kv):
        torch.testing.assert_close(keys, dense_keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(values, dense_values, atol=1e-4, rtol=1e-4)


def test_placeholders_leave_the_new_tokens_for_the_policy():
    """With placeholders the tokens between moved spans are not computed: zeros hold their slots."""
    from kvprof.model.buffers import BufferCache, KVBuffer

    class Stub:
        rope = None

        @staticmethod
        def prefix(agent):
            return []

        def forward(self, *args, **kwargs):
            raise AssertionError("no forward with placeholders")

    keys = torch.ones(1, 2, 3, 4)
    cache = BufferCache([KVBuffer.of(keys, keys, 20)], 3)
    store = SpanStore()
    store.turns[0] = KeptSequence(
        0,
        5,
        6,
        [  # computed at positions 6.. as read: nothing to re-rotate
            (torch.full((1, 2, 5, 4), 2.0), torch.full((1, 2, 5, 4), 3.0))
        ],
    )
    done = extend_over_moved(Stub(), "a", list(range(20)), cache, 3, [MovedSpan(6, 11, 0, 0)], store, True)
    assert done.placeholders == [(3, 6)] and done.computed == 0 and done.moved == 5
    layer_keys, layer_values = cache.layers[0].keys, cache.layers[0].values
    assert layer_keys.shape[2] == 11 and bool((layer_keys[:, :, 3:6] == 0).all())
    assert bool((layer_values[:, :, 6:11] == 3.0).all())


def test_online_group_chat_re_runs_serve_moved_spans(run_cli, tmp_path, monkeypatch):
    """A group chat imported from a log re-runs online as a group chat (the workflow's `group_chat`): the calls the
    agents generate leave the shared context the same way, and FullShared serves their moved spans as they come
    (`FollowedTimeline` finds them), with the dense re-run's accuracy unchanged."""
    from real_chat import import_demo_group_chat

    import kvprof.policies.base as base
    from kvprof.policies import PolicyVariant
    from kvprof.replay.branches import ReplayPlanSummary
    from kvprof.replay.online import run_online, summarise_online
    from kvprof.replay.records import DENSE
    from kvprof.traces.tasks import task_of
    from kvprof.traces.trace import read_header

    path = import_demo_group_chat(run_cli, tmp_path / "import")
    assert read_header(path).workflow["group_chat"] is True
    served = []
    original = base.extend_over_moved

    def spy(*args, **kwargs):
        done = original(*args, **kwargs)
        served.append(done.moved)
        return done

    monkeypatch.setattr(base, "extend_over_moved", spy)
    trajectories = read_trace(path).trajectories[:2]
    agents = load_agents_for_trace(path, device="cpu", dtype="float32")
    runs = run_online(agents, [task_of(traj) for traj in trajectories], [PolicyVariant("fullshared")])
    plan = ReplayPlanSummary()
    for traj in runs[DENSE]:
        plan.add(traj, "prompt")
    assert plan.moved > 0  # the online re-runs are group chats too
    assert sum(served) > 0
    accuracy = summarise_online(runs)
    assert accuracy[DENSE]["accuracy"] == 1.0 and accuracy["fullshared"]["tasks"] == 2
