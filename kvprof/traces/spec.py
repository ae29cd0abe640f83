"""The workflow spec: which agents exist, how they differ (LoRA adapter or role prompt), and the text layout.

A spec comes from a TOML file (`--workflow FILE`), CLI flags (`--agent NAME=ADAPTER_DIR`, `--role NAME=PROMPT`), or
both (flags override the file). Example::

    mode = "lora"                       # optional: inferred from the agents
    system_prompt = "You solve questions with a search tool.\\n"
    max_rounds = 4

    [agents.plan]
    adapter = "adapters/plan"           # lora mode: a PEFT adapter directory
    [agents.act]
    adapter = "adapters/act"
    max_new_tokens = 16

    # prompt mode instead:  [agents.plan]  prompt = "You are the planner. ..."

Layout of one turn's input (each piece is its own segment, tokenized on its own)::

    lora:   system | question | (cue, output, observation)* of earlier turns | cue of this turn
    prompt: role prompt of the acting agent (private) | question | ... | cue of this turn

Lora mode reads shared segments at identical positions; prompt mode after role prompts of different lengths. With a
`chat_template` each call is chat messages instead — system (role prompt), user (question), assistant (earlier outputs
by agent; `group_chat`: user messages with a name), tool (observations) — one segment per message
(`kvprof.traces.chat`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import tomllib

from kvprof.errors import KvprofError
from kvprof.fileio import JsonType, is_json, read_json_file, read_text_file, type_name

ROLES = ("plan", "act", "reflect")


@dataclass
class AgentSpec:
    name: str
    adapter: str | None = None
    prompt: str | None = None
    max_new_tokens: int | None = None


@dataclass
class WorkflowSpec:
    """Agents plus the templates that lay a trajectory out as text. All templates are plain `str.format` strings."""

    mode: str
    agents: list[AgentSpec]
    system_prompt: str = ""
    question_template: str = "Question: {question}\n"
    cue_template: str = "{agent}:"
    observation_template: str = "Observation: {observation}\n"
    stop: list[str] = field(default_factory=lambda: ["\n"])
    max_new_tokens: int = 32
    max_rounds: int = 4
    action_pattern: str = r"(\w+)\[(.*?)\]"
    answer_pattern: str = r"(?:answer|finish)\[(.*?)\]"
    chat_template: str | None = (
        None  # Jinja chat template the calls are rendered with (kvprof.traces.chat); None: own layout
    )
    # with a chat template: each agent reads the others' outputs as `user` messages with the author's name, its own as
    # `assistant` messages — a group chat as AutoGen / AG2 lay it out (False: every output an assistant message)
    group_chat: bool = False

    def agent(self, name: str) -> AgentSpec:
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise KvprofError(f"unknown agent name {name!r}; this workflow has {', '.join(self.names)}.")

    @property
    def names(self) -> list[str]:
        return [agent.name for agent in self.agents]

    def to_dict(self) -> dict:
        """The spec as a trace header holds it (`group_chat` only when set: traces of other layouts stay as they
        were)."""
        data = asdict(self)
        if not self.group_chat:
            del data["group_chat"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> WorkflowSpec:
        fields = dict(data)
        fields["agents"] = [AgentSpec(**agent) for agent in data["agents"]]
        return cls(**fields)


SETTING_TYPES: dict[str, JsonType] = {
    "mode": str,
    "system_prompt": str,
    "question_template": str,
    "cue_template": str,
    "observation_template": str,
    "stop": list,
    "max_new_tokens": int,
    "max_rounds": int,
    "action_pattern": str,
    "answer_pattern": str,
    "chat_template": (str, type(None)),
    "group_chat": bool,
}
AGENT_TYPES: dict[str, JsonType] = {
    "adapter": (str, type(None)),
    "prompt": (str, type(None)),
    "max_new_tokens": (int, type(None)),
}
PLACEHOLDERS = {"question_template": "question", "cue_template": "agent", "observation_template": "observation"}
GROUPS = {"action_pattern": 2, "answer_pattern": 1}  # the groups each pattern's matches are read from


def setting_problem(key: str, value: object) -> str | None:
    """Why `value` cannot be the workflow setting `key` (a TOML file's, or a trace header's workflow's), or None."""
    if key not in SETTING_TYPES:
        return f"is not a workflow setting (settings: {', '.join(SETTING_TYPES)})"
    kind = SETTING_TYPES[key]
    if not is_json(value, kind):
        return f"should be {type_name(kind)}, not {type(value).__name__}"
    if isinstance(value, list) and not all(isinstance(text, str) for text in value):
        return "should be a list of texts"
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        return f"is {value}; it should be at least 1"
    if key in PLACEHOLDERS and isinstance(value, str):
        try:
            value.format(**{PLACEHOLDERS[key]: ""})
        except (KeyError, IndexError, ValueError) as err:
            return f"is not a template of {{{PLACEHOLDERS[key]}}} alone ({type(err).__name__}: {err})"
    if key in GROUPS and isinstance(value, str):
        try:
            groups = re.compile(value).groups
        except re.error as err:
            return f"is not a regular expression ({err})"
        if groups < GROUPS[key]:
            return f"has {groups} groups; it needs {GROUPS[key]}"
    return None


def agent_problem(fields: object, keys: dict[str, JsonType] = AGENT_TYPES) -> str | None:
    """Why an agent's fields (TOML table or header object) cannot be used, or None."""
    if not isinstance(fields, dict):
        return "should be a table of adapter, prompt and max_new_tokens"
    for key, value in fields.items():
        if key not in keys:
            return f"has unknown key {key!r} (allowed: {', '.join(keys)})"
        if not is_json(value, keys[key]):
            return f"has {key} {type(value).__name__}, not {type_name(keys[key])}"
    if isinstance(fields.get("max_new_tokens"), int) and fields["max_new_tokens"] < 1:
        return f"has max_new_tokens {fields['max_new_tokens']}; it should be at least 1"
    return None


def parse_assignment(flag: str, value: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        raise KvprofError(f"{flag} {value!r} should look like NAME=VALUE (e.g. {flag} plan=adapters/plan).")
    return name.strip(), rest


def _infer_mode(agents: list[AgentSpec], declared: str | None, origin: str = "") -> str:
    """The workflow's mode: `declared`, else lora unless the agents have role prompts; `origin` begins refusals."""
    with_adapter = [a.name for a in agents if a.adapter]
    with_prompt = [a.name for a in agents if a.prompt is not None]
    if with_adapter and with_prompt:
        raise KvprofError(
            f"{origin}agents {', '.join(with_adapter)} have adapters but {', '.join(with_prompt)} have role "
            "prompts; give every agent an adapter (lora mode) or every agent a role prompt "
            "(prompt mode)."
        )
    mode = declared or ("prompt" if with_prompt else "lora")
    if mode not in ("lora", "prompt"):
        raise KvprofError(f"{origin}mode {mode!r} is not 'lora' or 'prompt'; set mode to one of them.")
    if mode == "prompt" and len(with_prompt) != len(agents):
        missing = [a.name for a in agents if a.prompt is None]
        raise KvprofError(
            f"{origin}prompt mode needs a role prompt for every agent, but {', '.join(missing)} has none; "
            "pass --role NAME=PROMPT for each."
        )
    return mode


def _read_workflow_file(path: Path, agents: dict[str, AgentSpec]) -> dict:
    """The settings of the TOML workflow file at `path`, its agents added to `agents` (adapter paths resolved
    against the file's folder); refused in one sentence naming the file."""
    fix = "pass a TOML workflow spec (e.g. kvprof/demo/assets/workflow_lora.toml)"
    try:
        raw = tomllib.loads(read_text_file(path, "workflow file", fix))
    except tomllib.TOMLDecodeError as err:
        raise KvprofError(f"workflow file {path} is not valid TOML ({err}); fix the file.") from None
    table = raw.pop("agents", {})
    if not isinstance(table, dict):
        raise KvprofError(f"workflow file {path}: 'agents' should be a table of [agents.NAME] tables; fix the file.")
    for key, value in raw.items():
        problem = setting_problem(key, value)
        if problem:
            raise KvprofError(f"workflow file {path}: '{key}' {problem}; fix the file.")
    for name, fields in table.items():
        problem = agent_problem(fields)
        if problem:
            raise KvprofError(f"workflow file {path}: agent {name!r} {problem}; fix the file.")
        adapter = fields.get("adapter")
        if adapter is not None and not Path(adapter).is_absolute():
            adapter = str((path.parent / adapter).resolve())
        agents[name] = AgentSpec(
            name=name, adapter=adapter, prompt=fields.get("prompt"), max_new_tokens=fields.get("max_new_tokens")
        )
    return raw


def _apply_agent_flags(agents: dict[str, AgentSpec], agent_flags: list[str], role_flags: list[str]) -> None:
    """--agent NAME=ADAPTER_DIR and --role NAME=PROMPT (or NAME=@FILE) over `agents`: each flag makes its agent a
    lora-mode or a prompt-mode one."""
    for value in agent_flags:
        name, adapter = parse_assignment("--agent", value)
        agents[name] = replace(agents.get(name, AgentSpec(name)), adapter=adapter, prompt=None)
    for value in role_flags:
        name, prompt = parse_assignment("--role", value)
        if prompt.startswith("@"):
            fix = f"pass --role {name}=@FILE with an existing text file, or the prompt text itself"
            prompt = read_text_file(prompt[1:], "role prompt file", fix)
        agents[name] = replace(agents.get(name, AgentSpec(name)), prompt=prompt, adapter=None)


def build_spec(
    workflow_file: str | Path | None = None,
    agent_flags: list[str] | None = None,
    role_flags: list[str] | None = None,
    base: WorkflowSpec | None = None,
    require_adapters: bool = True,
) -> WorkflowSpec:
    """Combine a base spec (e.g. a trace's), a TOML file and CLI flags, later ones overriding earlier ones."""
    data: dict = base.to_dict() if base else {}
    agents: dict[str, AgentSpec] = {a.name: a for a in (base.agents if base else [])}
    declared_mode = data.get("mode") if base else None
    if workflow_file is not None:
        raw = _read_workflow_file(Path(workflow_file), agents)
        declared_mode = raw.get("mode", declared_mode)
        data.update(raw)
    if agent_flags or role_flags:
        _apply_agent_flags(agents, agent_flags or [], role_flags or [])
        declared_mode = None
    origin = "" if workflow_file is None else f"workflow file {workflow_file}: "
    if not agents:
        raise KvprofError(
            f"{origin}no agents given; pass --agent NAME=ADAPTER_DIR (lora mode), --role NAME=PROMPT "
            "(prompt mode) or --workflow FILE."
        )
    agent_list = list(agents.values())
    mode = _infer_mode(agent_list, declared_mode, origin)
    if mode == "lora" and require_adapters:
        missing = [a.name for a in agent_list if not a.adapter]
        if missing:
            raise KvprofError(
                f"{origin}lora mode needs an adapter for every agent, but {', '.join(missing)} has none; "
                "pass --agent NAME=ADAPTER_DIR for each."
            )
    fields = {key: value for key, value in data.items() if key not in ("agents", "mode")}
    return WorkflowSpec(mode=mode, agents=agent_list, **fields)


def check_react_roles(spec: WorkflowSpec, origin: str = "") -> None:
    """Refuse roles other than plan, act, reflect, or a missing `act`; `origin` begins refusals."""
    unknown = [name for name in spec.names if name not in ROLES]
    if unknown:
        raise KvprofError(
            f"{origin}unknown agent name {', '.join(map(repr, unknown))}; the react schedule has the roles "
            f"{', '.join(ROLES)} — rename the agent to one of them."
        )
    if "act" not in spec.names:
        raise KvprofError(
            f"{origin}the react schedule needs an 'act' agent; pass --agent act=ADAPTER_DIR (or --role act=PROMPT)."
        )


def adapter_invocation(path: str | Path) -> list[int] | None:
    """The aLoRA invocation ids in `path`'s adapter_config.json, else None (also when missing)."""
    config_path = Path(path) / "adapter_config.json"
    if not config_path.is_file():
        return None
    config = read_json_file(config_path, "adapter config", "pass a PEFT adapter directory")
    tokens = config.get("alora_invocation_tokens") if isinstance(config, dict) else None
    return [int(token) for token in tokens] if tokens else None
