"""Chat logs as real frameworks write them, through real models' official chat templates (`tests/real_chat.py`):
every call the template itself renders imports, each turn's input ids are exactly what transformers'
`apply_chat_template(messages, tools=tools, add_generation_prompt=True)` gives, also where the template is not
incremental, and every reply read back differently from its generated ids is reported with its log line."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
from real_chat import (
    ADAPTERS,
    AGENTS,
    CASES,
    FAMILIES,
    MEMORY_TASKS,
    MODES,
    ROLE_PROMPTS,
    TASKS,
    build_family,
    import_demo_group_chat,
    log_cases,
    renderable,
    write_log,
)
from test_branches import brute_force_prefix, check_dense_is_a_full_forward
from test_policies import CASES as POLICY_CASES
from test_policies import check_variant
from transformers import AutoTokenizer

from kvprof.errors import KvprofError
from kvprof.fileio import write_json
from kvprof.kernels.attention import EXPAND, SHORT
from kvprof.kernels.transformers_attention import stored_value_calls
from kvprof.model import runtime as runtime_module
from kvprof.model.agents import load_agents_for_trace, tokenizer_identity
from kvprof.model.runtime import Runtime
from kvprof.policies import PolicyVariant, runnable_variants
from kvprof.policies.delta import pool_identity
from kvprof.policies.droidspeak import LayerProfile
from kvprof.replay.branches import ReplayPlanSummary
from kvprof.replay.lockstep import replay_trace
from kvprof.replay.setting import ReplaySettings
from kvprof.report.replay import policy_notes
from kvprof.traces.chat import PLAIN_TEMPLATE, ChatFormat, Message
from kvprof.traces.chat_log import import_log
from kvprof.traces.trace import read_trace, write_trace
from kvprof.tuning.anchor_fit import fit_pool, truncated


@pytest.fixture(scope="session")
def family_models(tiny_world, tmp_path_factory):
    """Each family's tiny model folder, built once per session."""
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(tiny_world, family, root / name) for name, family in FAMILIES.items()}


@pytest.fixture(scope="session")
def tokenizers(family_models):
    return {name: AutoTokenizer.from_pretrained(folder) for name, folder in family_models.items()}


def server_ids(tokenizer, record: dict) -> list[int]:
    """The ids a server gives the call: transformers' own `apply_chat_template`, tokenized."""
    out = tokenizer.apply_chat_template(
        record["messages"], tools=record.get("tools"), add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def replayable(tiny_world, family_models, tokenizer, family: str, mode: str, records: list[dict], folder):
    """The trajectories of `records` imported as a trace in `folder`, and the agents that replay it (lora modes: the
    shared-A adapters)."""
    imported = import_records(tiny_world, tokenizer, family, mode, records, folder / "log.jsonl")
    path = write_trace(folder / "trace.jsonl", imported.trace)
    lora = mode != "prompt"
    flags = [f"{agent}={tiny_world.shared_a_adapter(ADAPTERS[agent])}" for agent in AGENTS] if lora else None
    agents = load_agents_for_trace(path, model=str(family_models[family]), agent_flags=flags, device="cpu")
    return read_trace(path).trajectories, agents


def import_records(tiny_world, tokenizer, family: str, mode: str, records: list[dict], path):
    adapters = None if mode == "prompt" else {agent: str(tiny_world.adapter(ADAPTERS[agent])) for agent in AGENTS}
    log = write_log(records, path)
    template = FAMILIES[family].template_text
    return import_log(log, tokenizer, template, tokenizer_identity(tokenizer), family, adapters)


def read_backs(imported) -> list:
    return [difference for found in imported.differences.values() for difference in found if difference.producer]


MATRIX = [pytest.param(f, m, c, id=f"{f}-{m}-{c}") for f in FAMILIES for m in MODES for c in CASES]


@pytest.mark.parametrize(("family", "mode", "case"), MATRIX)
def test_renderable_logs_import_with_the_servers_ids(tokenizers, tiny_world, tmp_path, family, mode, case):
    tokenizer = tokenizers[family]
    records, refused = renderable(tokenizer, log_cases(mode)[case])
    if not records:
        pytest.skip(f"the {family} template refuses this shape: {refused[0]}")
    imported = import_records(tiny_world, tokenizer, family, mode, records, tmp_path / "log.jsonl")
    trace = read_trace(write_trace(tmp_path / "trace.jsonl", imported.trace))  # a valid trace
    by_trajectory = defaultdict(list)
    for record in records:
        by_trajectory[record["trajectory"]].append(record)
    assert [traj.id for traj in trace.trajectories] == list(by_trajectory)
    for traj in trace.trajectories:
        readers = defaultdict(set)
        for turn, record in zip(traj.turns, by_trajectory[traj.id], strict=True):
            assert turn.agent == record["agent"]
            assert traj.input_tokens(turn) == server_ids(tokenizer, record), (traj.id, turn.agent)
            assert traj.output_tokens(turn) == tokenizer.encode(record["output"], add_special_tokens=False)
            system = record["messages"][0]["content"]
            private = [traj.segments[seg_id] for seg_id in turn.input if traj.segments[seg_id].scope == "private"]
            if mode == "lora":  # one system message for every agent: nothing is private
                assert not private
            else:  # each agent's system message is its own
                assert any(segment.text == system for segment in private), (traj.id, turn.agent)
            for seg_id in turn.input:
                readers[seg_id].add(turn.agent)
        private_read = [agents for seg_id, agents in readers.items() if traj.segments[seg_id].scope == "private"]
        assert all(len(agents) == 1 for agents in private_read)  # private segments are one agent's own
        if mode != "lora":
            assert set(traj.private_prefixes()) == {record["agent"] for record in by_trajectory[traj.id]}
    if mode == "prompt":
        assert "most common system message" in imported.mode_reason
        assert {agent["name"]: agent["prompt"] for agent in trace.header.workflow["agents"]} == ROLE_PROMPTS
        memory = {traj.id: traj.private for traj in trace.trajectories}
        for task, private in enumerate(memory.values()):
            memorised = case == "memory" and task in MEMORY_TASKS  # the per-task text after each role prompt
            assert private == (dict.fromkeys(AGENTS, f" Memory: {TASKS[task][0]} is a painter.") if memorised else {})
    elif mode == "lora_agent_prompts":
        assert "each agent's system message is private" in imported.mode_reason


def expected_read_backs(records: list[dict]) -> set[tuple[int, int]]:
    """(reading line, producing line) of every reply a later call reads (log lines count from 1)."""
    pairs = set()
    for reader, record in enumerate(records):
        contents = {message.get("content") for message in record["messages"]}
        pairs |= {(reader + 1, line + 1) for line in range(reader) if records[line]["output"] in contents}
    return pairs


def test_trimmed_replies_are_reported_with_their_log_lines(tokenizers, tiny_world, tmp_path):
    """Llama 3.1 renders every message `| trim`: each reply with the whitespace models emit is read back without it,
    and every (reading line, reply line) pair is reported; Qwen 2.5 keeps the whitespace and reports none."""
    records = log_cases("prompt", trajectories=1)["whitespace"]
    imported = import_records(tiny_world, tokenizers["llama3.1"], "llama3.1", "prompt", records, tmp_path / "l.jsonl")
    found = read_backs(imported)
    reported = {(d.line, d.first_line) for d in found} | {(line, d.first_line) for d in found for line in d.also}
    assert reported == expected_read_backs(records) and len(reported) > len(found)
    first = found[0]
    assert (first.line, first.first_line, first.agent, first.producer) == (2, 1, "executor", "planner")
    assert first.describe().startswith(
        "line 2: agent 'executor' reads the reply of line 1 (planner) differently from its generated ids (token 0: "
    )
    qwen = import_records(tiny_world, tokenizers["qwen2.5"], "qwen2.5", "prompt", records, tmp_path / "q.jsonl")
    assert not read_backs(qwen)


def test_group_chat_replies_read_as_user_messages_are_reported(tokenizers, tiny_world, tmp_path):
    """AutoGen / AG2: another agent's reply arrives as a user message with a name; its ids are the generated ones,
    but read after the user header instead of the generation prompt it was generated after."""
    records = log_cases("prompt", trajectories=1)["group_chat"]
    imported = import_records(tiny_world, tokenizers["qwen2.5"], "qwen2.5", "prompt", records, tmp_path / "g.jsonl")
    found = read_backs(imported)
    assert found and all("same ids, read after '<|im_start|>user\\n'" in d.describe() for d in found)
    own = {(d.line, d.first_line) for d in found} | {(line, d.first_line) for d in found for line in d.also}
    assert all(records[reader - 1]["agent"] != records[line - 1]["agent"] for reader, line in own)


def test_a_reply_merged_with_the_token_before_it_is_reported(tiny_world, tmp_path):
    """Contents back to back through a byte-level BPE: after "You act " the space and the reply "abc" become one
    token, so the executor does not read the ids the planner generated."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.model)
    records = [
        {"agent": "planner", "messages": [{"role": "system", "content": "You plan."}], "output": "abc"},
        {
            "agent": "executor",
            "messages": [
                {"role": "system", "content": "You act "},
                {"role": "assistant", "name": "planner", "content": "abc"},
            ],
            "output": " ok",
        },
    ]
    log = write_log(records, tmp_path / "log.jsonl")
    imported = import_log(log, tokenizer, PLAIN_TEMPLATE, tokenizer_identity(tokenizer), "tiny")
    (found,) = read_backs(imported)
    assert (found.line, found.first_line, found.producer) == (2, 1, "planner") and "(token 0: " in found.describe()
    (traj,) = imported.trace.trajectories
    assert traj.input_tokens(traj.turns[1]) == tokenizer.encode("You act abc", add_special_tokens=False)


def test_cli_prints_the_first_differences_and_writes_all(family_models, tiny_world, tmp_path, run_cli):
    records = log_cases("prompt", trajectories=2)["whitespace"]
    log = write_log(records, tmp_path / "log.jsonl")
    code, out, err = run_cli("import-chat", log, "--model", family_models["llama3.1"], "--out", tmp_path / "o")
    assert code == 0, err
    assert "line 2: agent 'executor' reads the reply of line 1 (planner) differently from its generated ids" in out
    result = json.loads((tmp_path / "o" / "import-chat.json").read_text())
    differences = result["differences"]
    assert len(differences) == 12 and all(d["read_back"] and d["line"] for d in differences)
    assert "... and 2 more (all in OUT/import-chat.json)" in out


def test_a_call_without_its_agents_activated_lora_invocation_is_refused(family_models, tiny_world, tmp_path, run_cli):
    """With Activated LoRA adapters, every call must hold its agent's invocation ids (peft runs a call without them
    on the base model alone): the first call that lacks them is refused with its log line, exit 2, no trace."""
    tokenizer = AutoTokenizer.from_pretrained(family_models["llama3.1"])
    records = log_cases("lora", trajectories=1)["documented"]
    log = write_log(records, tmp_path / "log.jsonl")
    generation_prompt = server_ids(tokenizer, records[0])[-4:]  # in every call; the others' cue in none
    flags = []
    for agent in AGENTS:
        folder = tmp_path / "adapters" / agent
        folder.mkdir(parents=True)
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8}
        config["alora_invocation_tokens"] = (
            generation_prompt if agent == "planner" else tokenizer.encode("nobody says this", add_special_tokens=False)
        )
        write_json(str(folder / "adapter_config.json"), config)
        flags += ["--agent", f"{agent}={folder}"]
    code, _, err = run_cli(
        "import-chat", log, "--model", family_models["llama3.1"], *flags, "--out", tmp_path / "o"
    )  # fmt: skip
    first = next(index for index, record in enumerate(records, 1) if record["agent"] != "planner")
    assert code == 2 and f"line {first}: agent " in err and "lacks the invocation ids" in err, err
    assert "Traceback" not in err and not (tmp_path / "o" / "trace.jsonl").exists()


def test_activated_lora_agents_with_their_own_system_prompts_share_exactly(
    tiny_world, family_models, tokenizers, tmp_path
):
    """Activated LoRA agents invoked by the Llama 3.1 generation prompt (their adapters act on their replies only),
    each with its own system prompt, on the group chat: ALoRAShared reuses the base K/V of the common start and of
    what each agent's earlier calls held, and stays NonShared's to float rounding, prefilling fewer tokens."""
    from transformers import AutoModelForCausalLM

    from kvprof.model.tiny import build_adapter

    family = "llama3.1"
    tokenizer = tokenizers[family]
    records, _ = renderable(tokenizer, log_cases("lora_agent_prompts", trajectories=2)["group_chat"])
    imported = import_records(tiny_world, tokenizer, family, "lora_agent_prompts", records, tmp_path / "log.jsonl")
    path = write_trace(tmp_path / "trace.jsonl", imported.trace)
    generation_prompt = server_ids(tokenizer, records[0])[-4:]
    flags = []
    for seed, agent in enumerate(AGENTS):
        model = AutoModelForCausalLM.from_pretrained(family_models[family])
        build_adapter(model, tmp_path / "alora" / agent, seed=30 + seed, invocation=generation_prompt)
        flags.append(f"{agent}={tmp_path / 'alora' / agent}")
    agents = load_agents_for_trace(path, model=str(family_models[family]), agent_flags=flags, device="cpu")
    trajectories = read_trace(path).trajectories
    result = replay_trace(agents, trajectories, [PolicyVariant("alorashared"), PolicyVariant("nonshared")])
    shared, nonshared = result["policies"]["alorashared"]["summary"], result["policies"]["nonshared"]["summary"]
    assert shared["kl"] < 1e-9 and shared["k_error"] < 1e-5 and shared["v_error"] < 1e-5 and shared["top1"] == 1.0
    assert shared["prefilled"] < nonshared["prefilled"] and shared["adapter_made"] > 0


def test_templates_that_move_messages_fall_back_to_the_whole_rendering(tokenizers):
    """Mistral moves the system prompt into the last user message: the call is split in text order (contents
    located, template text between them), its ids exactly the server's; per-message spans are refused."""
    tokenizer = tokenizers["mistral-nemo"]
    chat = ChatFormat(tokenizer, FAMILIES["mistral-nemo"].template_text)
    messages = [
        Message("system", ROLE_PROMPTS["planner"]),
        Message("user", "Where was Kalomir born?"),
        Message("assistant", "search[Kalomir]"),
        Message("user", "Observation: Kalomir is a painter."),
    ]
    rendering = chat.render(messages)
    assert not rendering.incremental
    assert [tok for piece in rendering.pieces for tok in piece.ids] == rendering.ids
    assert rendering.ids == server_ids(tokenizer, {"messages": [m.as_dict() for m in messages]})
    assert [piece.message for piece in rendering.pieces if piece.part == "content"] == [1, 2, 0, 3]
    with pytest.raises(KvprofError, match="out of their order"):
        chat.spans(messages)


def test_template_files_name_their_source_and_render_as_without_the_header(tokenizers):
    messages = [{"role": "user", "content": "Where was Kalomir born?"}, {"role": "assistant", "content": "Norvash"}]
    messages.append({"role": "user", "content": "Why?"})
    for name, family in FAMILIES.items():
        header, body = family.template_text.split("\n", 1)
        assert header.startswith("{#-") and header.endswith("-#}") and "huggingface/huggingface.js" in header
        render = tokenizers[name].apply_chat_template
        assert render(messages, chat_template=family.template_text, tokenize=False) == render(
            messages, chat_template=body, tokenize=False
        )


@pytest.mark.parametrize(("family", "mode", "case"), MATRIX)
def test_renderable_logs_replay_every_turn_under_every_policy(
    family_models, tokenizers, tiny_world, tmp_path, family, mode, case
):
    """Issue #31's acceptance, per renderable case (its first trajectory; the first two of the memory and tool-call
    cases, whose second carries per-task memory and the parallel tool call): every policy of the mode, at its
    default options, replays every turn (the option sweeps of `--policy all` replay branching traces in
    tests/test_branches.py); the dense run's logits equal the model's own forward over each turn's whole input and
    outputs; in lora mode FullShared reuses, per turn, exactly the longest common prefix of the server's ids for the
    call with any earlier call's ids and outputs (short of the last input id), computed here from the log alone."""
    tokenizer = tokenizers[family]
    records, refused = renderable(
        tokenizer, log_cases(mode, trajectories=2 if case in ("memory", "tool_calls") else 1)[case]
    )
    if not records:
        pytest.skip(f"the {family} template refuses this shape: {refused[0]}")
    trajectories, agents = replayable(tiny_world, family_models, tokenizer, family, mode, records, tmp_path)
    lora = mode != "prompt"
    names = dict.fromkeys(variant.name for m, variant in POLICY_CASES if m == ("lora" if lora else "prompt"))
    variants = [PolicyVariant(name) for name in names]
    runnable, skipped = runnable_variants(variants, Runtime(agents), skip=True)
    assert not skipped
    result = replay_trace(agents, trajectories, runnable)
    assert result["dense"]["summary"]["turns"] == len(records)
    for entry in result["policies"].values():
        check_variant(entry, result["dense"], memory_checked=False)
    # FullShared prefills exactly what `kvprof inspect` counts as new: no moved span recomputed
    plan = ReplayPlanSummary()
    for traj in trajectories:
        plan.add(traj, "lora" if lora else "prompt")
    assert result["policies"]["fullshared"]["summary"]["prefilled"] == plan.new
    assert result["policies"]["fullshared"]["summary"]["moved"] == plan.moved
    if lora:
        calls = iter(result["policies"]["fullshared"]["turns"])
        by_trajectory = defaultdict(list)
        for record in records:
            by_trajectory[record["trajectory"]].append(record)
        for calls_of_trajectory in by_trajectory.values():
            sequences: list[list[int]] = []
            for record in calls_of_trajectory:
                ids = server_ids(tokenizer, record)
                assert next(calls)["reused"] == min(brute_force_prefix(ids, sequences), len(ids) - 1)
                sequences.append(ids + tokenizer.encode(record["output"], add_special_tokens=False))
    check_dense_is_a_full_forward(agents, trajectories)


@pytest.mark.parametrize("mode", ["prompt", "lora_agent_prompts"])
def test_moved_spans_of_a_group_chat_are_reused_and_full_recompute_is_dense(
    tiny_world, family_models, tokenizers, tmp_path, mode
):
    """On the Llama 3.1 template's group chat (others' replies read as `user` messages after each agent's own role
    prompt): FullShared and the selective policies serve moved spans re-aligned (a prefix cache could not), and with
    every token recomputed (ratio 1) CacheBlend, RelayCaching and DroidSpeak — whose blend covers the moved spans and
    the new tokens between them — equal the dense run; DroidSpeak's block after layer 0 starts from the hidden states
    the source turns held."""
    family = "llama3.1"
    tokenizer = tokenizers[family]
    records, _ = renderable(tokenizer, log_cases(mode, trajectories=2)["group_chat"])
    trajectories, agents = replayable(tiny_world, family_models, tokenizer, family, mode, records, tmp_path)
    lora = mode != "prompt"
    layers = agents.config.num_hidden_layers
    profile = tmp_path / "profile.json"  # the last layer deviates most: DroidSpeak's block starts after layer 0
    write_json(str(profile), LayerProfile([0.0] * (layers - 1) + [1.0], [1.0] * layers, 1).to_json("tiny"))
    variants = [
        PolicyVariant("fullshared"),
        PolicyVariant("cacheblend"),
        PolicyVariant("cacheblend", {"ratio": "1"}),
        PolicyVariant("relaycaching", {"ratio": "1"}),
        PolicyVariant("droidspeak", {"ratio": "1"}),
        PolicyVariant("droidspeak", {"ratio": str(1 / layers), "profile": str(profile)}),
    ]
    if lora:  # the LoRA family moves its base and LR caches
        variants += [
            PolicyVariant("prelrshared"),
            PolicyVariant("prelrshared", {"views": "kept"}),
            PolicyVariant("baselrshared"),
            PolicyVariant("rebaseshared"),
            PolicyVariant("rebaseshared", {"schedule": "db"}),
            PolicyVariant("baseshared"),
        ]
    result = replay_trace(agents, trajectories, variants)
    policies = result["policies"]
    plan = ReplayPlanSummary()
    for traj in trajectories:
        plan.add(traj, "lora" if lora else "prompt")
    assert plan.moved > 0 and result["dense"]["summary"]["timeline"]["moved_tokens"] == plan.moved
    notes = policy_notes(result)
    block = f"droidspeak-ratio={1 / layers}"
    assert f"recomputes layer {layers - 1} of {layers}" in policies[block]["notes"][0]
    for label in policies:
        if label.startswith("baseshared"):  # its LR prefill runs the backbone over every token its LR cache lacks
            assert any(note.startswith(f"{label}: does not move spans") for note in notes)
            continue
        assert policies[label]["summary"]["moved"] == plan.moved, label
        assert not any(note.startswith(f"{label}: does not move spans") for note in notes)
    for label in ("fullshared", "prelrshared", "prelrshared-kept", "baselrshared"):
        if label in policies:
            assert policies[label]["summary"]["prefilled"] == plan.new, label
    if lora:  # the neutral base is re-aligned like any other; the turns' new tokens are prefilled as FullShared's
        for label in ("rebaseshared-lp", "rebaseshared-db"):
            assert policies[label]["summary"]["prefilled"] == plan.new, label
        kept, per_turn = policies["prelrshared-kept"]["summary"], policies["prelrshared"]["summary"]
        assert kept["kl"] == pytest.approx(per_turn["kl"], rel=1e-4, abs=1e-9)
        assert policies["rebaseshared-lp"]["summary"]["kl"] == pytest.approx(
            policies["rebaseshared-db"]["summary"]["kl"], rel=1e-3, abs=1e-9
        )
    for label in ("cacheblend-ratio=1", "relaycaching-ratio=1", "droidspeak-ratio=1"):
        summary = policies[label]["summary"]
        assert summary["kl"] < 1e-6 and summary["k_error"] < 1e-4 and summary["v_error"] < 1e-4, label
        assert summary["top1"] == 1.0
    # re-aligned moved spans cost fidelity (another agent's context shaped them) and the blend wins part of it back
    full, blend = policies["fullshared"]["summary"], policies["cacheblend-ratio=0.16"]["summary"]
    assert 0 < blend["k_error"] < full["k_error"]
    assert 0 < policies[block]["summary"]["k_error"] < full["k_error"]


def test_low_rank_policies_moving_spans_equal_fullshared_when_every_agent_has_the_same_adapter(
    tiny_world, family_models, tokenizers, tmp_path
):
    """Lora mode with per-agent system prompts, one adapter for every agent: a token's base plus the reader's B over
    the producer's X·A is the producer's own K/V, so PreLRShared and BaseLRShared moving a span (base keys
    re-rotated, the key LR term rotated at the reader's positions, LR caches copied) must give FullShared's turns,
    which re-rotate the producer's K/V — to float tolerance, through the moved spans of the Llama group chat."""
    family = "llama3.1"
    tokenizer = tokenizers[family]
    records, _ = renderable(tokenizer, log_cases("lora_agent_prompts", trajectories=2)["group_chat"])
    imported = import_records(tiny_world, tokenizer, family, "lora_agent_prompts", records, tmp_path / "log.jsonl")
    path = write_trace(tmp_path / "trace.jsonl", imported.trace)
    same = tiny_world.shared_a_adapter(ADAPTERS["executor"])
    agents = load_agents_for_trace(
        path, model=str(family_models[family]), agent_flags=[f"{agent}={same}" for agent in AGENTS], device="cpu"
    )
    variants = [PolicyVariant(name) for name in ("fullshared", "prelrshared", "baselrshared")]
    result = replay_trace(agents, read_trace(path).trajectories, variants)
    policies = result["policies"]
    full = policies["fullshared"]
    assert full["summary"]["moved"] > 0 and full["summary"]["kl"] > 1e-6  # moved spans cost fidelity
    for label in ("prelrshared", "baselrshared"):
        assert policies[label]["summary"]["moved"] == full["summary"]["moved"], label
        for turn, reference in zip(policies[label]["turns"], full["turns"]):
            assert turn["kl_sum"] == pytest.approx(reference["kl_sum"], rel=1e-3, abs=1e-6), label
            for layer, reference_layer in zip(turn["layers"], reference["layers"], strict=True):
                assert layer["k_error"] == pytest.approx(reference_layer["k_error"], rel=1e-3, abs=1e-6), label
                assert layer["v_error"] == pytest.approx(reference_layer["v_error"], rel=1e-3, abs=1e-6), label


def test_low_rank_policies_over_stored_values_move_spans_as_over_expanded_views(
    tiny_world, family_models, tokenizers, tmp_path, monkeypatch
):
    """Lora mode with per-agent system prompts, each agent its own adapter (shared A), through the moved spans of the
    Llama group chat: attending the rank-r values as stored (`--lora-attention auto`'s path for short forwards on CPU,
    here taken by every forward) gives each low-rank policy the expanded views' turns: KL and the reused and moved
    spans' K/V errors."""
    family = "llama3.1"
    tokenizer = tokenizers[family]
    records, _ = renderable(tokenizer, log_cases("lora_agent_prompts", trajectories=2)["group_chat"])
    imported = import_records(tiny_world, tokenizer, family, "lora_agent_prompts", records, tmp_path / "log.jsonl")
    path = write_trace(tmp_path / "trace.jsonl", imported.trace)
    flags = [f"{agent}={tiny_world.shared_a_adapter(ADAPTERS[agent])}" for agent in AGENTS]
    agents = load_agents_for_trace(path, model=str(family_models[family]), agent_flags=flags, device="cpu")
    variants = [
        PolicyVariant("prelrshared"),
        PolicyVariant("baselrshared"),
        PolicyVariant("rebaseshared"),
        PolicyVariant("rebaseshared", {"schedule": "db"}),
        PolicyVariant("baseshared"),
    ]
    trajectories = read_trace(path).trajectories
    expanded = replay_trace(agents, trajectories, variants, ReplaySettings(lora_attention=EXPAND))
    monkeypatch.setattr(runtime_module, "values_as_stored_pay", lambda group, tokens, head_dim, keys: True)
    calls = stored_value_calls()
    stored = replay_trace(agents, trajectories, variants, ReplaySettings(lora_attention=SHORT))
    assert stored_value_calls() > calls
    for label, entry in stored["policies"].items():
        reference = expanded["policies"][label]
        assert entry["summary"]["moved"] == reference["summary"]["moved"], label
        assert label.startswith("baseshared") or entry["summary"]["moved"] > 0, label
        for turn, expected in zip(entry["turns"], reference["turns"], strict=True):
            assert turn["kl_sum"] == pytest.approx(expected["kl_sum"], rel=1e-3, abs=1e-6), label
            for layer, expected_layer in zip(turn["layers"], expected["layers"], strict=True):
                for key in ("k_error", "v_error"):
                    assert layer[key] == pytest.approx(expected_layer[key], rel=1e-3, abs=1e-6), (label, key)


def test_delta_policies_fitted_on_half_a_group_chat_correct_its_moved_spans(
    tiny_world, family_models, tokenizers, tmp_path
):
    """KVComm and KVCMAS with pools fitted (`kvprof.tuning.anchor_fit`, moved spans as placeholder segments) on half of
    the Llama 3.1 group chat's trajectories replay the other half correcting moved spans, with ρ and KL (the demo group
    chat's test below re-runs it online for accuracy: these agents are not kvprof's ReAct roles)."""
    family = "llama3.1"
    tokenizer = tokenizers[family]
    records, _ = renderable(tokenizer, log_cases("prompt", trajectories=4)["group_chat"])
    trajectories, agents = replayable(tiny_world, family_models, tokenizer, family, "prompt", records, tmp_path)
    runtime = Runtime(agents)
    half = len(trajectories) // 2
    pool = fit_pool(runtime, trajectories[:half], capacity=10)
    assert any(slot.endswith(".moved") for slot in pool.slots)
    identity = pool_identity(runtime)
    full = pool.save(tmp_path / "full.safetensors", identity)
    low = truncated(pool, 32).save(tmp_path / "low.safetensors", identity)
    variants = [
        PolicyVariant("kvcomm", {"anchors": str(full)}),
        PolicyVariant("kvcmas", {"anchors": str(low)}),
    ]
    result = replay_trace(agents, trajectories[half:], variants)
    check_fitted_delta_replay(result)


def check_fitted_delta_replay(result: dict) -> None:
    """KVComm and KVCMAS served moved spans corrected (not only recomputed), with ρ, KL and the error by hop."""
    moved = result["dense"]["summary"]["timeline"]["moved_tokens"]
    assert moved > 0
    for label in ("kvcomm", "kvcmas-chain"):
        summary = result["policies"][label]["summary"]
        assert summary["moved"] > 0, label
        assert summary["moved"] + summary["moved_recomputed"] == moved
        assert summary["delta_reuse"] is not None and 0 < summary["delta_reuse"] <= 1
        assert math.isfinite(summary["kl"]) and summary["error_by_hop"]


def test_delta_policies_fitted_on_half_the_demo_group_chat_report_accuracy(run_cli, tmp_path):
    """The same through the commands on the demo's group-chat log (the demo workflow, so online re-runs work):
    import-chat, fit-anchors on two trajectories (full-dimensional for KVComm, rank 32 for KVCMAS), replay the other
    two online."""
    trace = str(import_demo_group_chat(run_cli, tmp_path / "import"))
    for rank, folder in (("full", "full"), ("32", "low")):
        code, out, err = run_cli("fit-anchors", trace, "--limit", "2", "--rank", rank, "--out", str(tmp_path / folder))
        assert code == 0, err
    code, out, err = run_cli(
        "replay",
        trace,
        "--skip",
        "2",
        "--online",
        "--repeats",
        "1",
        "--policy",
        "kvcomm",
        "--policy",
        "kvcmas",
        "--policy-option",
        f"kvcomm.anchors={tmp_path / 'full' / 'anchors.safetensors'}",
        "--policy-option",
        f"kvcmas.anchors={tmp_path / 'low' / 'anchors.safetensors'}",
        "--out",
        str(tmp_path / "replay"),
    )
    assert code == 0, err
    result = json.loads((tmp_path / "replay" / "replay.json").read_text())
    check_fitted_delta_replay(result)
    for label in ("kvcomm", "kvcmas-chain"):
        assert result["online"][label]["accuracy"] is not None and result["online"][label]["tasks"] == 2


def test_online_replay_refuses_agents_the_react_schedule_cannot_run(run_cli, tiny_world, tokenizers, tmp_path):
    """A log whose agents are not kvprof's ReAct roles replays teacher-forced; --online is refused in one sentence
    before any model loads."""
    family = "llama3.1"
    records, _ = renderable(tokenizers[family], log_cases("prompt", trajectories=1)["documented"])
    imported = import_records(tiny_world, tokenizers[family], family, "prompt", records, tmp_path / "log.jsonl")
    path = write_trace(tmp_path / "trace.jsonl", imported.trace)
    code, out, err = run_cli("replay", str(path), "--online", "--policy", "fullshared", "--out", str(tmp_path / "r"))
    assert code == 2 and "drop --online" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "replay.json").exists()
