"""Real chat templates and the chat-log shapes real frameworks write, on the tiny world (for `test_chat_real_logs`).

`FAMILIES`: four model families, each with its official chat template (`tests/data/chat_templates/`, a one-line
Jinja comment on top naming where the text came from) and the special tokens it needs; `build_family` makes a local
tokenizer + model folder of the tiny world's model with them. `log_cases` gives chat logs (one agent call per record)
in the shapes frameworks log: kvprof's documented layout, an AutoGen/AG2 group chat, LangGraph / OpenAI-Agents tool
calls, outputs with the whitespace models emit, per-task memory in the system message, and strictly alternating
user/assistant turns as Mistral and Gemma templates require. Contents are built from words the tiny tokenizer knows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
AGENTS = ("planner", "executor", "critic")
ADAPTERS = {"planner": "plan", "executor": "act", "critic": "reflect"}  # the tiny world's adapter of each agent
ROLE_PROMPTS = {
    "planner": "You plan the next search step.",
    "executor": "You act: search[NAME] or finish[ANSWER].",
    "critic": "You are the reviewer. Give the final answer as answer[ANSWER] after checking.",
}
SHARED_SYSTEM = "Answer with the search tool."
TASKS = [  # person, father, birthplace
    ("Kalomir", "Tevren", "Norvash"),
    ("Tevren", "Brinoth", "Osmadal"),
    ("Brinoth", "Kalomir", "Quessa"),
    ("Halwick", "Tevren", "Norvash"),
]
SCRIPT = ("planner", "executor", "critic", "planner", "executor", "executor", "critic")  # who acts, call by call
MEMORY_TASKS = (1, 3)  # case memory: these tasks' system messages carry per-task memory
PARALLEL_TASK = 1  # case tools: this task's second search is two parallel tool calls
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base for a name.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "The name to search for."}},
                "required": ["query"],
            },
        },
    }
]
CASES = ("documented", "group_chat", "tool_calls", "whitespace", "memory", "alternating")
MODES = ("prompt", "lora", "lora_agent_prompts")


@dataclass(frozen=True)
class Family:
    """A model family: its template file, the special tokens its template writes (`plain`: added tokens that are not
    special, as Qwen's tool-call tags), and its BOS / EOS tokens."""

    name: str
    template: str
    special: tuple[str, ...]
    bos: str | None
    eos: str
    plain: tuple[str, ...] = ()

    @property
    def template_text(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")


FAMILIES = {
    family.name: family
    for family in (
        Family(
            "llama3.1",
            "llama-3.1-8b-instruct.jinja",
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
        ),
        Family(
            "qwen2.5",
            "qwen2.5-7b-instruct.jinja",
            ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            bos=None,
            eos="<|im_end|>",
            plain=("<tool_call>", "</tool_call>"),
        ),
        Family(
            "mistral-nemo",
            "mistral-nemo-instruct-2407.jinja",
            (
                "<unk>",
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            bos="<s>",
            eos="</s>",
        ),
        Family(
            "gemma3",
            "gemma-3-270m-it.jinja",
            ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
            bos="<bos>",
            eos="<eos>",
        ),
    )
}


def build_family(world, family: Family, folder: Path) -> Path:
    """The tiny world's model with `family`'s special tokens, BOS / EOS and chat template, saved under `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(world.model)
    tokens: dict = {"additional_special_tokens": list(family.special), "eos_token": family.eos}
    if family.bos is not None:
        tokens["bos_token"] = family.bos
    tokenizer.add_special_tokens(tokens)
    if family.plain:
        tokenizer.add_tokens(list(family.plain))
    tokenizer.chat_template = family.template_text
    model = AutoModelForCausalLM.from_pretrained(world.model)
    model.resize_token_embeddings(len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass
class Event:
    """Something a later call reads: an agent's reply (`agent`, its text, and its tool calls when it called tools)
    or a tool result (`agent` None)."""

    agent: str | None
    text: str | None
    calls: list[dict] | None = None
    call_id: str | None = None


def _replies(task: int, whitespace: bool) -> list[tuple[str | None, list[dict] | None, list[str]]]:
    """Per call of `SCRIPT`: its output text, its tool calls (or None) and the tool results it gets back."""
    person, father, place = TASKS[task]
    searches = [[person], [father, place] if task == PARALLEL_TASK else [father]]
    found = {
        person: f"Observation: {person} is a painter with father {father} and birthplace {place}.",
        father: f"No results for {father}.",
        place: f"No results for {place}.",
    }
    texts = [
        f"Plan: search {person}, then his father.",
        f"search[{person}]",
        f"Check: {person} was born in {place}.",
        f"Plan: finish with {place}.",
        f"search[{father}]",
        f"finish[{place}]",
        f"answer[{place}]",
    ]
    if whitespace:  # as models emit them: a leading space, a trailing newline
        texts = [f" {text}\n" for text in texts]
    out: list[tuple[str | None, list[dict] | None, list[str]]] = []
    search = iter(searches)
    for number, (agent, text) in enumerate(zip(SCRIPT, texts)):
        if agent == "executor" and text.strip().startswith("search["):
            names = next(search)
            calls = [
                {
                    "id": f"call{task}{number}{index:03d}",  # nine alphanumeric characters, as Mistral's template asks
                    "type": "function",
                    "function": {"name": "search", "arguments": json.dumps({"query": name})},
                }
                for index, name in enumerate(names)
            ]
            out.append((text, calls, [found[name] for name in names]))
        else:
            out.append((text, None, []))
    return out


def _messages(case: str, agent: str, system: str, question: str, events: list[Event]) -> list[dict]:
    """What `agent` is called with, in the layout of `case`."""
    messages: list[dict] = [{"role": "system", "content": system}]
    if case == "alternating":  # user/assistant strictly alternating: everything not the agent's own merged into user
        turns: list[dict] = [{"role": "user", "content": question}]
        for event in events:
            if event.agent == agent:
                turns.append({"role": "assistant", "content": event.text})
            elif turns[-1]["role"] == "user":
                turns[-1]["content"] += "\n" + _plain(event)
            else:
                turns.append({"role": "user", "content": _plain(event)})
        if turns[-1]["role"] == "assistant":
            turns.append({"role": "user", "content": "Continue."})
        return messages + turns
    if case == "group_chat":  # AutoGen / AG2: others' messages as user messages with a name, its own as assistant
        messages.append({"role": "user", "name": "user", "content": question})
        for event in events:
            if event.agent == agent:
                messages.append({"role": "assistant", "content": event.text})
            else:
                messages.append({"role": "user", "name": event.agent or "user_proxy", "content": _plain(event)})
        return messages
    messages.append({"role": "user", "content": question})
    for event in events:
        if event.agent is None:
            result: dict = {"role": "tool", "content": event.text}
            if event.call_id is not None:
                result |= {"tool_call_id": event.call_id, "name": "search"}
            messages.append(result)
        elif event.calls is not None:  # content null or empty, as frameworks log tool-calling turns
            content = None if len(messages) % 2 else ""
            messages.append({"role": "assistant", "name": event.agent, "content": content, "tool_calls": event.calls})
        else:
            messages.append({"role": "assistant", "name": event.agent, "content": event.text})
    return messages


def _plain(event: Event) -> str:
    return event.text or ""


def _trajectory(case: str, task: int, system_of: Callable[[str, int], str]) -> list[dict]:
    person, _, place = TASKS[task]
    question = f"Where was {person} born?"
    events: list[Event] = []
    records = []
    for agent, (text, calls, results) in zip(SCRIPT, _replies(task, whitespace=case == "whitespace")):
        record: dict = {
            "agent": agent,
            "messages": _messages(case, agent, system_of(agent, task), question, events),
            "trajectory": f"task-{task}",
        }
        if case == "tool_calls" and calls is not None:
            record["output"] = json.dumps([call["function"] for call in calls])
            record["tools"] = TOOLS
            events.append(Event(agent, None, calls))
            events += [Event(None, result, call_id=call["id"]) for call, result in zip(calls, results)]
        else:
            record["output"] = text
            if case == "tool_calls" and agent == "executor":
                record["tools"] = TOOLS
            events.append(Event(agent, text))
            if calls is not None:
                events += [Event(None, result) for result in results]
        if not records:
            record["task"] = {"question": question, "answer": place}
        records.append(record)
    return records


def log_cases(mode: str = "prompt", trajectories: int = len(TASKS)) -> dict[str, list[dict]]:
    """Each case's chat log (records in log order: `trajectories` tasks × 7 calls by planner / executor / critic).

    mode: "prompt" and "lora_agent_prompts" give each agent its role prompt as its system message; "lora" gives every
    agent one shared system message. Case "memory" adds per-task memory to the system messages of `MEMORY_TASKS`."""

    def system_of(case: str) -> Callable[[str, int], str]:
        def system(agent: str, task: int) -> str:
            text = SHARED_SYSTEM if mode == "lora" else ROLE_PROMPTS[agent]
            if case == "memory" and task in MEMORY_TASKS:
                text += f" Memory: {TASKS[task][0]} is a painter."
            return text

        return system

    return {
        case: [record for task in range(trajectories) for record in _trajectory(case, task, system_of(case))]
        for case in CASES
    }


def renderable(tokenizer, records: list[dict]) -> tuple[list[dict], list[str]]:
    """The records of the trajectories the tokenizer's template renders in full, and the template's own error for
    each trajectory it refuses."""
    refused: dict[str, str] = {}
    for record in records:
        if record["trajectory"] in refused:
            continue
        try:
            tokenizer.apply_chat_template(
                record["messages"], tools=record.get("tools"), add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # the template's own raise_exception, or a Jinja error
            refused[record["trajectory"]] = f"{type(err).__name__}: {err}"
    return [record for record in records if record["trajectory"] not in refused], list(refused.values())


def write_log(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def import_demo_group_chat(run_cli, out: Path) -> Path:
    """`kvprof import-chat` of the demo world's group-chat log into `out`; returns the trace's path."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    code, _, err = run_cli(
        "import-chat",
        str(world.sample_group_chat_log),
        "--model",
        str(world.model),
        "--chat-template",
        str(world.chat_template),
        "--workflow",
        str(world.prompt_workflow),
        "--out",
        str(out),
    )
    assert code == 0, err
    return out / "trace.jsonl"
