"""Before any load: the server serves the model names the traffic needs, tokenizes the trace's text to its ids, and
holds the longest turn."""

from __future__ import annotations

from kvprof.errors import KvprofError
from kvprof.serving.client import ServerClient
from kvprof.serving.traffic import ServedModels
from kvprof.traces.spec import adapter_invocation
from kvprof.traces.trace import TraceHeader, Trajectory

TOKENIZER_SEGMENTS = 6  # input segments of the first turn whose tokenization is compared


def served_models(client: ServerClient, header: TraceHeader, patterns: list[str], base: str | None) -> ServedModels:
    """Served names of the base model (`base`, else the one listed model that is not an adapter) and, for `agents` in
    lora mode, each agent's adapter."""
    listed = client.models()
    names = [str(entry.get("id")) for entry in listed]
    if base is None:
        bases = [str(entry.get("id")) for entry in listed if not entry.get("parent")]
        if len(bases) != 1:
            raise KvprofError(
                f"the server at {client.url} serves {len(bases)} base models ({', '.join(bases) or 'none'}); pass "
                "--served-base NAME with the one the trace was captured with."
            )
        base = bases[0]
    elif base not in names:
        raise KvprofError(
            f"the server at {client.url} does not serve --served-base {base!r} (it serves {', '.join(names)}); pass "
            "one of those."
        )
    adapters: dict[str, str] = {}
    if header.mode == "lora" and "agents" in patterns:
        missing = [agent for agent in header.agent_names if agent not in names]
        if missing:
            raise KvprofError(
                f"the server at {client.url} serves no LoRA adapter named {', '.join(map(repr, missing))} (it serves "
                f"{', '.join(names)}); start vLLM with --lora-modules NAME=ADAPTER_DIR for each of the trace's agents "
                "(named after them), or run --pattern base alone."
            )
        adapters = {agent: agent for agent in header.agent_names}
    return ServedModels(base=base, adapters=adapters)


def refuse_activated_lora(header: TraceHeader, patterns: list[str], trace_name: str) -> None:
    """Refuse `--pattern agents` with aLoRA agents: vLLM ≤ 0.32 refuses to load them. `--pattern base` serves every
    turn on the base model (what an aLoRA-aware engine shares before each invocation)."""
    if header.mode != "lora" or "agents" not in patterns:
        return
    activated = [
        agent["name"]
        for agent in header.workflow.get("agents", [])
        if agent.get("adapter") and adapter_invocation(agent["adapter"]) is not None
    ]
    if activated:
        raise KvprofError(
            f"the agents {', '.join(activated)} of {trace_name} are Activated LoRA adapters, which vLLM does not serve "
            "(it refuses them at load); run --pattern base alone: every turn on the base model's prefix cache, the "
            "sharing an aLoRA deployment has before each call's invocation."
        )


def check_tokenizer(client: ServerClient, model: str, trajectory: Trajectory, trace_name: str) -> bool:
    """Refuse another tokenizer: each of the first turn's text segments (up to `TOKENIZER_SEGMENTS`) must tokenize to
    the recorded ids, or the ids detokenize to the text. Returns whether any could be checked (shape-only: none)."""
    checked = 0
    for seg_id in dict.fromkeys(trajectory.turns[0].input):
        segment = trajectory.segments[seg_id]
        if not segment.text or segment.kind == "synthetic":
            continue
        if client.tokenize(model, segment.text) != segment.tokens and client.detokenize(model, segment.tokens) != (
            segment.text
        ):
            raise KvprofError(
                f"the server at {client.url} tokenizes the text of segment {seg_id!r} of trajectory {trajectory.id!r} "
                f"of {trace_name} to other ids than the trace's, so it runs another tokenizer; serve the model the "
                "trace was captured with."
            )
        checked += 1
        if checked == TOKENIZER_SEGMENTS:
            break
    return checked > 0


def check_context(client: ServerClient, model: str, trajectories: list[Trajectory]) -> None:
    """Refuse a server whose context is shorter than the longest turn (input plus recorded output)."""
    limit = next((entry.get("max_model_len") for entry in client.models() if entry.get("id") == model), None)
    if not limit:
        return
    longest, where = 0, ""
    for traj in trajectories:
        for index, turn in enumerate(traj.turns):
            length = len(traj.input_tokens(turn)) + len(traj.output_tokens(turn))
            if length > longest:
                longest, where = length, f"turn {index} of trajectory {traj.id!r}"
    if longest > int(limit):
        raise KvprofError(
            f"the server at {client.url} serves {model!r} with a context of {limit} tokens, shorter than {where} "
            f"({longest} tokens); start it with a larger --max-model-len."
        )
