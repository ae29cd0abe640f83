"""Agent calls rendered through chat templates (`kvprof.traces.chat`): capture renders every call exactly as
transformers' `apply_chat_template` does, shared messages become shared segments, and `kvprof import-chat` turns chat
logs into traces — reporting messages whose tokens depend on their context."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvprof.capture.workflow import SearchTool, run_react
from kvprof.demo.assets import demo_world
from kvprof.model.agents import load_agents, tokenizer_identity
from kvprof.policies import PolicyVariant
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.chat import PLAIN_TEMPLATE, ChatFormat, Message
from kvprof.traces.chat_log import import_log, trajectory_calls
from kvprof.traces.spec import build_spec
from kvprof.traces.tasks import load_tasks
from kvprof.traces.trace import read_trace, shared_segment_ids

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_STYLE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_world, tmp_path_factory):
    """The tiny world's model with a Llama-3-style chat template and its special tokens, built locally."""
    folder = tmp_path_factory.mktemp("chat") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.model)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.chat_template = LLAMA3_STYLE
    model = AutoModelForCausalLM.from_pretrained(tiny_world.model)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def rendered_by_transformers(tokenizer, messages: list[Message]) -> list[int]:
    out = tokenizer.apply_chat_template([m.as_dict() for m in messages], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def messages_of(traj, turn) -> list[Message]:
    """The messages a turn's input segments stand for (the oracle's view, from the trace alone)."""
    roles = {"prompt": "system", "system": "system", "question": "user", "observation": "tool"}
    messages = []
    for seg_id in turn.input:
        segment = traj.segments[seg_id]
        if segment.kind in roles:
            messages.append(Message(roles[segment.kind], segment.text))
        elif segment.kind in ("output", "message"):
            messages.append(Message("assistant", segment.text, segment.producer))
    return messages


def test_capture_renders_every_call_as_apply_chat_template(chat_model, tiny_world, tmp_path, run_cli):
    code, out, err = run_cli(
        "capture", "--model", str(chat_model), "--workflow", str(tiny_world.prompt_workflow),
        "--tasks", str(tiny_world.tasks), "--out", str(tmp_path), "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    assert "chat template" in out
    trace = read_trace(tmp_path / "trace.jsonl")
    assert trace.header.workflow["chat_template"] == LLAMA3_STYLE
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    for traj in trace.trajectories:
        for turn in traj.turns:
            assert traj.input_tokens(turn) == rendered_by_transformers(tokenizer, messages_of(traj, turn))
        shared = shared_segment_ids(traj)
        question = next(seg_id for seg_id, seg in traj.segments.items() if seg.kind == "question")
        assert question in shared
        prompts = {seg_id for seg_id, seg in traj.segments.items() if seg.kind == "prompt"}
        assert len(prompts) == 3 and not prompts & shared  # each role prompt is one agent's own


def test_outputs_read_back_extend_one_timeline_and_replay(chat_model, tiny_world):
    """Replies that end with the end-of-turn token are read back as the generation prompt + output segments that
    produced them: every later call extends the same shared tokens, so every prompt-mode policy replays."""
    spec = build_spec(tiny_world.prompt_workflow)
    agents = load_agents(spec, str(chat_model), device="cpu", dtype="float32")
    agents.spec.chat_template = LLAMA3_STYLE
    tokenizer = agents.tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    replies = {"plan": "Look up the person.", "act": "search[Kalomir]", "reflect": "answer[Norvash]"}

    def respond(agent, input_ids, max_new):
        assert input_ids[-4:] == tokenizer.encode("<|start_header_id|>assistant<|end_header_id|>\n\n")[-4:]
        return tokenizer.encode(replies[agent], add_special_tokens=False) + [eot]

    traj = run_react(agents.spec, tokenizer, load_tasks(tiny_world.tasks)[0], SearchTool(), respond)
    assert not any(seg.kind == "message" for seg in traj.segments.values())  # every reply read back as produced
    read = {seg_id for turn in traj.turns for seg_id in turn.input}
    assert {turn.output for turn in traj.turns[:-1]} <= read
    for turn in traj.turns:
        assert traj.input_tokens(turn) == rendered_by_transformers(tokenizer, messages_of(traj, turn))
    result = replay_trace(agents, [traj], [PolicyVariant("fullshared"), PolicyVariant("nonshared")])
    assert result["policies"]["nonshared"]["summary"]["kl"] == 0.0
    assert result["policies"]["fullshared"]["summary"]["reuse_per_token"] > 0


def test_sample_log_imports_to_the_demo_trace_and_replays_online(tmp_path, run_cli):
    world = demo_world()
    code, out, err = run_cli(
        "import-chat", str(world.sample_chat_log), "--model", str(world.model),
        "--chat-template", str(world.chat_template), "--workflow", str(world.prompt_workflow),
        "--out", str(tmp_path / "import"),
    )  # fmt: skip
    assert code == 0, err
    assert "prompt mode" in out
    imported = read_trace(tmp_path / "import" / "trace.jsonl")
    original = read_trace(world.sample_traces["prompt_short"])
    for mine, theirs in zip(imported.trajectories, original.trajectories, strict=True):
        assert [mine.input_tokens(t) for t in mine.turns] == [theirs.input_tokens(t) for t in theirs.turns]
        assert [mine.output_tokens(t) for t in mine.turns] == [theirs.output_tokens(t) for t in theirs.turns]
        assert mine.prediction == theirs.prediction and mine.prediction is not None
    code, out, err = run_cli(
        "replay", str(tmp_path / "import" / "trace.jsonl"), "--online", "--limit", "2", "--repeats", "1",
        "--out", str(tmp_path / "replay"),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert result["dense"]["summary"]["trace_agreement"] == 1.0  # the log's outputs came from this model
    assert {"fullshared", "nonshared"} <= set(result["policies"])
    assert set(result["online"]) == {"dense", *result["policies"]}  # every policy re-ran the workflow online
    assert result["online"]["dense"]["accuracy"] == 1.0 and result["online"]["dense"]["tasks"] == 2


def test_context_dependent_tokenization_is_reported(tiny_world, tmp_path):
    """Contents back to back through a byte-level BPE: after "You act " the space and "abc" become one token, which
    starts in the role prompt; after "You plan." they do not. The import keeps each call's exact ids and reports
    the message."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.model)
    calls = [
        {"agent": "plan", "messages": [{"role": "system", "content": "You plan."}, {"role": "user", "content": "abc"}]},
        {"agent": "act", "messages": [{"role": "system", "content": "You act "}, {"role": "user", "content": "abc"}]},
        {"agent": "act", "messages": [{"role": "system", "content": "You act "}, {"role": "user", "content": "abc"}]},
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(call | {"output": " ok"}) + "\n" for call in calls))
    chat = ChatFormat(tokenizer, PLAIN_TEMPLATE)
    assert (
        chat.spans([Message("system", "You plan."), Message("user", "abc")])[0][1]
        != chat.spans([Message("system", "You act "), Message("user", "abc")])[0][1]
    ), "the test needs a message whose tokens depend on what precedes it"
    imported = import_log(log, tokenizer, PLAIN_TEMPLATE, tokenizer_identity(tokenizer), str(tiny_world.model))
    (differences,) = imported.differences.values()
    assert len(differences) == 1 and "'abc'" in differences[0].describe()  # reported once, where it first differs
    (traj,) = imported.trace.trajectories
    assert traj.turns[1].input == traj.turns[2].input  # the second rendering is one segment, shared by its calls
    for turn, call in zip(traj.turns, calls):
        messages = [Message(m["role"], m["content"]) for m in call["messages"]]
        assert traj.input_tokens(turn) == chat.ids(messages, generation_prompt=True)
    assert [line["messages"] for line in trajectory_calls(traj)] == [call["messages"] for call in calls]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"agent": "act", "output": "x"}', "no list field 'messages'"),
        ('{"agent": "act", "messages": [{"role": "narrator", "content": "x"}], "output": "y"}', "message 0"),
        (
            '{"agent": "act", "messages": [{"role": "system", "content": "s"}, '
            '{"role": "assistant", "name": "act", "content": "y"}], "output": "y"}',
            "its own output as the last message",
        ),
        ('{"agent": "act", "messages": [{"role": "user", "content": "q"}], "output": "y"}', "no system message"),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_logs_name_the_line_and_the_fix(tiny_world, tmp_path, run_cli, line, expected):
    log = tmp_path / "log.jsonl"
    log.write_text(line + "\n")
    code, out, err = run_cli("import-chat", str(log), "--model", str(tiny_world.model), "--out", str(tmp_path / "o"))
    assert code == 2 and expected in err and "line 1" in err
    assert not (tmp_path / "o" / "trace.jsonl").exists()


def test_unknown_agent_and_missing_template_are_refused(tiny_world, tmp_path, run_cli):
    log = tmp_path / "log.jsonl"
    log.write_text('{"agent": "act", "messages": [{"role": "user", "content": "q"}], "output": "y"}\n')
    code, _, err = run_cli(
        "import-chat", str(log), "--model", str(tiny_world.model), "--agent", f"plan={tiny_world.adapter('plan')}",
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 2 and "agent 'act' has no adapter" in err
    code, _, err = run_cli(
        "capture", "--model", str(tiny_world.model), "--workflow", str(tiny_world.prompt_workflow),
        "--tasks", str(tiny_world.tasks), "--chat-template", "on", "--out", str(tmp_path / "c"),
    )  # fmt: skip
    assert code == 2 and "has no chat template" in err
