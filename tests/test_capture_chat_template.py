"""Capture through an official chat template (Llama 3.1's, from the public tokenizer config, in tests/data): replies
end where a server ends them (the template's end-of-turn token), are read back as the template renders them, and
replay replays every captured turn under every policy, whatever the template re-renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_policies import check_variant
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvprof.capture.workflow import SearchTool, run_react
from kvprof.demo.assets import demo_world
from kvprof.model.agents import load_agents
from kvprof.replay.branches import plan_of
from kvprof.traces.spec import build_spec
from kvprof.traces.stopping import end_ids, end_of_turn
from kvprof.traces.tasks import load_tasks
from kvprof.traces.trace import read_trace

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
LLAMA_31 = TEMPLATES / "llama-3.1-8b-instruct.jinja"
LLAMA_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


@pytest.fixture(scope="module")
def llama_model(tiny_world, tmp_path_factory):
    """The tiny world's model with Llama 3.1's special tokens (BOS `<|begin_of_text|>`) and official template."""
    folder = tmp_path_factory.mktemp("llama31") / "model"
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.model)
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens": LLAMA_SPECIAL})
    tokenizer.chat_template = LLAMA_31.read_text()
    model = AutoModelForCausalLM.from_pretrained(tiny_world.model)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_end_of_turn_is_the_token_the_template_closes_a_reply_with(llama_model):
    tokenizer = AutoTokenizer.from_pretrained(llama_model)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn(tokenizer, LLAMA_31.read_text()) == eot
    assert end_of_turn(tokenizer, demo_world().chat_template.read_text()) is None  # the demo layout closes nothing
    assert end_ids(tokenizer, None, LLAMA_31.read_text()) == [x for x in (tokenizer.eos_token_id, eot) if x is not None]


def test_a_reply_ending_at_the_end_of_turn_is_read_back_as_generated(llama_model, tiny_world):
    """Llama 3.1 trims a reply's content when it renders it back: a reply generated without surrounding whitespace
    and closed by <|eot_id|> is read back as the very ids generated, so later calls extend it."""
    spec = build_spec(tiny_world.prompt_workflow)
    agents = load_agents(spec, str(llama_model), device="cpu", dtype="float32")
    agents.spec.chat_template = LLAMA_31.read_text()
    tokenizer = agents.tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")

    def respond(agent, input_ids, max_new):
        reply = {"plan": "Look up the person.", "act": "search[Kalomir]", "reflect": "answer[Norvash]"}[agent]
        return tokenizer.encode(reply, add_special_tokens=False) + [eot]

    traj = run_react(agents.spec, tokenizer, load_tasks(tiny_world.tasks)[0], SearchTool(), respond)
    assert not any(seg.kind == "message" for seg in traj.segments.values())  # no reply re-rendered differently
    read = {seg_id for turn in traj.turns for seg_id in turn.input}
    assert {turn.output for turn in traj.turns[:-1]} <= read
    plan = plan_of(traj, traj.private_prefixes())
    assert all(start.divergence is None and start.restore is None for start in plan)  # one growing context


@pytest.mark.parametrize("mode", ["lora", "prompt"])
def test_capture_through_the_llama_template_replays_every_turn(llama_model, tiny_world, tmp_path, run_cli, mode):
    workflow = tiny_world.lora_workflow if mode == "lora" else tiny_world.prompt_workflow
    code, out, err = run_cli(
        "capture", "--model", str(llama_model), "--workflow", str(workflow), "--tasks", str(tiny_world.tasks),
        "--chat-template", str(LLAMA_31), "--max-new-tokens", "6", "--out", str(tmp_path / "capture"),
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    trace = read_trace(tmp_path / "capture" / "trace.jsonl")
    turns = sum(len(traj.turns) for traj in trace.trajectories[:2])
    code, out, err = run_cli(
        "replay", str(tmp_path / "capture" / "trace.jsonl"), "--limit", "2", "--repeats", "1",
        "--out", str(tmp_path / "replay"), "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert result["dense"]["summary"]["turns"] == turns
    assert result["dense"]["summary"]["trace_agreement"] == 1.0
    assert result["dense"]["summary"]["timeline"]["causes"].get("re-rendered reply")  # `| trim` re-rendered replies
    assert {"nonshared", "fullshared"} <= set(result["policies"])
    for entry in result["policies"].values():
        check_variant(entry, result["dense"], memory_checked=False)
