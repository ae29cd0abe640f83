"""The template check: a call's input token count as the trace recorded it (the server's usage) against the ids
kvprof renders for it.

Tracing stores record the prompt's token count beside the messages (`gen_ai.usage.input_tokens`,
`llm.token_count.prompt`, `usage.prompt_tokens`, `usage.input_tokens`). When kvprof's rendering of the same messages
has another length, the ids kvprof would replay are not the ones the server ran: the export left out the tool
definitions the server rendered into the prompt, or the server used another chat template (or passed
`chat_template_kwargs` such as `enable_thinking`). Each such call is one `TokenCountMismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenCountMismatch:
    """A call (`where` in the input, its `trajectory` and `agent`) whose `rendered` ids differ in number from the
    `recorded` input tokens; `has_tools`: whether the export gave the call tool definitions; `log_uses_tools`:
    whether any call of the log calls a tool or reads a tool's result."""

    where: str
    trajectory: str
    agent: str
    rendered: int
    recorded: int
    has_tools: bool
    log_uses_tools: bool = True

    def cause(self) -> str:
        """The likeliest reason, from what the export holds: a log whose agents never use tools lost no tool
        definitions."""
        if not self.has_tools and self.log_uses_tools and self.recorded > self.rendered:
            return (
                "the export holds no tool definitions for this call and the server's prompt was longer: tool "
                "definitions missing from the export (or another chat template)"
            )
        return (
            "another chat template than the server's, or chat_template_kwargs it was passed (pass its template "
            "with --chat-template FILE)"
        )

    def describe(self) -> str:
        return (
            f"{self.where}: agent {self.agent!r} renders to {self.rendered} ids, the trace records {self.recorded} "
            f"input tokens; likely cause: {self.cause()}"
        )


def mismatch(
    where: str,
    trajectory: str,
    agent: str,
    rendered: int,
    recorded: int | None,
    has_tools: bool,
    log_uses_tools: bool = True,
) -> TokenCountMismatch | None:
    """The mismatch of one call, or None when the trace records no count or the counts agree."""
    if recorded is None or recorded == rendered:
        return None
    return TokenCountMismatch(where, trajectory, agent, rendered, recorded, has_tools, log_uses_tools)
