"""`kvprof capture` end to end on the tiny world, and its refusals of bad input."""

from __future__ import annotations

import json

import pytest

from kvprof.model.tiny import build_adapter, tiny_config
from kvprof.traces.trace import read_partial_trace, read_trace, shared_segment_ids


def _capture(run_cli, world, out, *extra):
    return run_cli("capture", "--model", world.model, "--tasks", world.tasks, "--out", out, "--device", "cpu", *extra)


def test_capture_lora_mode(run_cli, tiny_world, tmp_path):
    code, out, err = _capture(
        run_cli,
        tiny_world,
        tmp_path,
        "--agent",
        f"plan={tiny_world.adapter('plan')}",
        "--agent",
        f"act={tiny_world.adapter('act')}",
        "--max-rounds",
        "2",
        "--max-new-tokens",
        "6",
    )
    assert code == 0, err
    assert "r=4, alpha=8, on q/k/v/o" in out
    trace = read_trace(tmp_path / "trace.jsonl")
    assert trace.header.mode == "lora" and trace.header.agent_names == ["plan", "act"]
    assert len(trace.trajectories) == 3
    for traj in trace.trajectories:
        assert [t.agent for t in traj.turns][:2] == ["plan", "act"]
        # matched prefix: every turn starts with the same shared segments
        assert all(t.input[:2] == ["question", "cue:plan:0"] for t in traj.turns)
        assert all(len(traj.segments[t.output]) <= 6 for t in traj.turns)
    result = json.loads((tmp_path / "capture.json").read_text())
    assert result["schema"] == "kvprof.result.capture" and result["summary"]["trajectories"] == 3


def test_capture_prompt_mode_positions_differ(run_cli, tiny_world, tmp_path):
    code, _, err = _capture(run_cli, tiny_world, tmp_path, "--workflow", tiny_world.prompt_workflow)
    assert code == 0, err
    trace = read_trace(tmp_path / "trace.jsonl")
    assert trace.header.mode == "prompt"
    traj = trace.trajectories[0]
    starts = {}
    for turn in traj.turns:
        assert traj.segments[turn.input[0]].scope == "private" and turn.input[0] == f"prompt:{turn.agent}"
        starts[turn.agent] = {s: a for s, a, _ in traj.segment_spans(turn)}["question"]
    assert len(set(starts.values())) == len(starts) == 3  # role prompts of different lengths
    assert "question" in shared_segment_ids(traj)


def test_capture_is_deterministic_and_samples(run_cli, tiny_world, tmp_path):
    args = ("--workflow", tiny_world.lora_workflow, "--temperature", "1.0", "--seed", "5")
    assert _capture(run_cli, tiny_world, tmp_path / "a", *args)[0] == 0
    assert _capture(run_cli, tiny_world, tmp_path / "b", *args)[0] == 0
    assert (tmp_path / "a/trace.jsonl").read_bytes() == (tmp_path / "b/trace.jsonl").read_bytes()
    assert _capture(run_cli, tiny_world, tmp_path / "c", "--workflow", tiny_world.lora_workflow)[0] == 0
    assert (tmp_path / "a/trace.jsonl").read_bytes() != (tmp_path / "c/trace.jsonl").read_bytes()


def test_shape_import_via_cli(run_cli, tiny_world, tmp_path):
    csv_path = tmp_path / "s.csv"
    csv_path.write_text("agent,prefill_len,decode_len\nplan,40,8\nact,8,4\n")
    code, out, err = run_cli("capture", "--model", tiny_world.model, "--shapes", csv_path, "--out", tmp_path)
    assert code == 0, err
    code, out, _ = run_cli("inspect", tmp_path / "trace.jsonl", "--model", tiny_world.model)
    assert code == 0 and "valid: 1 trajectories" in out and "tokenizer matches" in out


@pytest.fixture(scope="module")
def foreign_adapter(tmp_path_factory):
    """An adapter trained for a base model of another width."""
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("foreign") / "adapter"
    build_adapter(LlamaForCausalLM(tiny_config(363, 0, hidden=96)), path, seed=0)
    return path


def _one_line_error(code, out, err, *fragments):
    assert code != 0
    assert "Traceback" not in err + out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_inputs(run_cli, tiny_world, tmp_path, foreign_adapter, lora_trace):
    plan = f"plan={tiny_world.adapter('plan')}"
    act = f"act={tiny_world.adapter('act')}"
    _one_line_error(
        *_capture(
            run_cli, tiny_world, tmp_path, "--agent", plan, "--agent", act, "--tasks", tmp_path / "missing.jsonl"
        ),
        "missing.jsonl does not exist",
    )
    bad_tasks = tmp_path / "tasks.jsonl"
    bad_tasks.write_text('{"id": 1, "question": "q"}\n{"id": 2, "question": \n')
    _one_line_error(
        *run_cli(
            "capture",
            "--model",
            tiny_world.model,
            "--tasks",
            bad_tasks,
            "--agent",
            plan,
            "--agent",
            act,
            "--out",
            tmp_path,
        ),
        "line 2 is not valid JSON",
    )
    _one_line_error(
        *_capture(run_cli, tiny_world, tmp_path, "--agent", f"act={foreign_adapter}"),
        "trained for another base model",
        "pass an adapter trained on this --model",
    )
    _one_line_error(
        *_capture(
            run_cli,
            tiny_world,
            tmp_path,
            "--agent",
            plan,
            "--agent",
            act,
            "--agent",
            f"critic={tiny_world.adapter('reflect')}",
        ),
        "unknown agent name 'critic'",
    )
    _one_line_error(
        *_capture(run_cli, tiny_world, tmp_path, "--agent", plan, "--role", "act=You act."),
        "have adapters but act have role prompts",
    )
    _one_line_error(
        *run_cli("capture", "--model", tmp_path / "nomodel", "--tasks", tiny_world.tasks, "--agent", act),
        "nomodel",
        "pass --model with a local model directory",
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text(lora_trace.read_text().splitlines()[0] + "\n{oops\n")
    _one_line_error(*run_cli("inspect", broken), "broken.jsonl line 2")
    _one_line_error(*run_cli("inspect", tmp_path / "nothing.jsonl"), "does not exist")
    other_model = tmp_path / "other"
    from kvprof.model.tiny import build_tokenizer

    build_tokenizer(vocab_size=300).save_pretrained(other_model)
    _one_line_error(
        *run_cli("inspect", lora_trace, "--model", other_model),
        "captured with tokenizer",
        "pass --model with the model the trace was captured with",
    )
    assert not (tmp_path / "trace.jsonl").exists()  # nothing half-written


def _count_tasks(monkeypatch, interrupt_at: int | None = None) -> list[str]:
    """Wrap capture's runner: the returned list collects the ids of the tasks it runs; with `interrupt_at`, the
    runner raises KeyboardInterrupt (as Ctrl-C does) on that task (1-based)."""
    import kvprof.capture.runner as capture_module

    monkeypatch.undo()
    real_run_react, calls = capture_module.run_react, []

    def run_react(spec, tokenizer, task, *rest, **kwargs):
        calls.append(task.id)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return real_run_react(spec, tokenizer, task, *rest, **kwargs)

    monkeypatch.setattr(capture_module, "run_react", run_react)
    return calls


def test_interrupted_capture_resumes_to_the_same_trace(run_cli, tiny_world, tmp_path, monkeypatch):
    """A capture interrupted at its third task leaves a checkpoint and no trace; `--resume` runs only the rest and
    writes the trace an uninterrupted capture writes, byte for byte."""
    args = ("--workflow", tiny_world.lora_workflow, "--temperature", "1.0", "--seed", "3")
    assert _capture(run_cli, tiny_world, tmp_path / "whole", *args)[0] == 0
    _count_tasks(monkeypatch, interrupt_at=3)
    code, _, err = _capture(run_cli, tiny_world, tmp_path / "cut", *args)
    assert code == 130 and "--resume" in err
    assert not (tmp_path / "cut/trace.jsonl").exists()
    checkpoint = tmp_path / "cut/trace.partial.jsonl"
    with open(checkpoint, "a") as torn:
        torn.write('{"record":"trajectory","id":"tor')
    assert len(read_partial_trace(checkpoint).trajectories) == 2
    calls = _count_tasks(monkeypatch)
    code, out, err = _capture(run_cli, tiny_world, tmp_path / "cut", *args, "--resume")
    assert code == 0, err
    assert "resuming after 2 captured tasks" in out and len(calls) == 1
    assert (tmp_path / "cut/trace.jsonl").read_bytes() == (tmp_path / "whole/trace.jsonl").read_bytes()
    assert not checkpoint.exists()


def test_resume_refuses_another_capture_s_checkpoint(run_cli, tiny_world, tmp_path, monkeypatch):
    _count_tasks(monkeypatch, interrupt_at=2)
    assert _capture(run_cli, tiny_world, tmp_path, "--workflow", tiny_world.lora_workflow)[0] == 130
    monkeypatch.undo()
    code, out, err = _capture(
        run_cli, tiny_world, tmp_path, "--workflow", tiny_world.lora_workflow, "--seed", "9", "--resume"
    )
    _one_line_error(code, out, err, "trace.partial.jsonl", "another model, tokenizer, workflow or sampling")
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(reversed(tiny_world.tasks.read_text().splitlines(keepends=True))))
    code, out, err = run_cli(
        "capture",
        "--model",
        tiny_world.model,
        "--tasks",
        reordered,
        "--out",
        tmp_path,
        "--device",
        "cpu",
        "--workflow",
        tiny_world.lora_workflow,
        "--resume",
    )
    _one_line_error(code, out, err, "trace.partial.jsonl", "not the first tasks of --tasks")


def _model_with_tokenizer(tokenizer, path):
    """A tiny untrained model directory with `tokenizer` (vocabulary and EOS sized to it)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(len(tokenizer), tokenizer.eos_token_id)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _tokenizer_without_newline():
    """A Metaspace BPE whose vocabulary has no "\\n" (it encodes as <unk>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvprof.model.tiny import CORPUS

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    bpe.train_from_iterator(
        CORPUS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<unk>"], show_progress=False)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    assert "\n" not in tokenizer.decode(tokenizer.encode("a\nb"))
    return tokenizer


def _tokenizer_without_decoder():
    """A byte-level BPE without a decoder: transformers' StopStringCriteria cannot map its vocabulary to text."""
    from kvprof.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.decoder = None
    return tokenizer


@pytest.mark.parametrize("make_tokenizer", [_tokenizer_without_decoder, _tokenizer_without_newline])
def test_capture_and_replay_with_any_tokenizer(run_cli, tiny_world, tmp_path, make_tokenizer):
    """Stop strings are found in the decoded text, so tokenizers transformers' stop-string matching fails on
    capture (transformers' generate) and replay online (greedy decoding in the runtime)."""
    model = _model_with_tokenizer(make_tokenizer(), tmp_path / "model")
    code, _, err = run_cli(
        "capture", "--model", model, "--tasks", tiny_world.tasks, "--workflow", tiny_world.prompt_workflow,
        "--limit", "1", "--out", tmp_path / "capture", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    trace = tmp_path / "capture" / "trace.jsonl"
    assert run_cli("inspect", trace, "--model", model)[0] == 0
    code, _, err = run_cli(
        "replay", trace, "--policy", "fullshared", "--online", "--repeats", "1", "--out", tmp_path / "replay",
        "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err


def test_capture_refuses_a_tokenizer_that_cannot_decode(run_cli, tiny_world, tmp_path, monkeypatch):
    from kvprof.model.agents import load_tokenizer

    def decode(self, *args, **kwargs):
        raise NotImplementedError("this tokenizer has no decoder")

    monkeypatch.setattr(type(load_tokenizer(str(tiny_world.model))), "decode", decode)
    _one_line_error(
        *_capture(run_cli, tiny_world, tmp_path, "--workflow", tiny_world.lora_workflow),
        "cannot turn token ids back into text (NotImplementedError: this tokenizer has no decoder)",
        "pass --model with a model whose tokenizer decodes",
    )
    assert not list(tmp_path.iterdir())  # nothing written


def test_shape_import_records_the_workflow_s_agents(run_cli, tiny_world, tmp_path):
    """With --workflow, a --shapes trace records the agents' adapters (or role prompts), so replay needs no
    --agent; CSV agents the workflow does not define, and a contradicting --mode, are refused."""
    csv_path = tmp_path / "s.csv"
    csv_path.write_text("agent,prefill_len,decode_len\nplan,20,4\nact,6,3\nreflect,5,2\n")
    for mode, workflow in (("lora", tiny_world.lora_workflow), ("prompt", tiny_world.prompt_workflow)):
        out = tmp_path / mode
        code, _, err = run_cli(
            "capture", "--model", tiny_world.model, "--shapes", csv_path, "--workflow", workflow, "--out", out
        )
        assert code == 0, err
        trace = read_trace(out / "trace.jsonl")
        assert trace.header.mode == mode and trace.header.source == "shape-csv:s.csv"
        if mode == "lora":
            adapters = {agent["name"]: agent["adapter"] for agent in trace.header.workflow["agents"]}
            assert adapters["act"] == str(tiny_world.adapter("act").resolve())
        else:
            turn = trace.trajectories[0].turns[1]
            assert turn.input[0] == "prompt:act" and "prompt:plan" not in turn.input
        code, _, err = run_cli(
            "replay", out / "trace.jsonl", "--policy", "fullshared", "--limit", "1", "--repeats", "1",
            "--out", out / "replay", "--device", "cpu",
        )  # fmt: skip
        assert code == 0, err
    csv_path.write_text("agent,prefill_len,decode_len\ncritic,20,4\n")
    shapes = ("capture", "--model", tiny_world.model, "--shapes", csv_path, "--out", tmp_path / "bad")
    _one_line_error(
        *run_cli(*shapes, "--workflow", tiny_world.lora_workflow),
        "has turns of agent 'critic', which the workflow does not define (its agents: plan, act, reflect)",
    )
    _one_line_error(
        *run_cli(*shapes, "--workflow", tiny_world.prompt_workflow, "--mode", "lora"),
        "--mode lora contradicts the agents, which are in prompt mode",
    )
    assert not (tmp_path / "bad").exists()
