"""Agent calls as chat messages, rendered through a chat template into the segments of a trajectory.

Instruct models are served through their tokenizer's chat template: an agent call is a list of messages — the agent's
role prompt as its system message (prompt mode), the question as a user message, earlier agents' outputs as
assistant messages carrying the agent's name, tool observations as tool messages — rendered by
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`. kvprof renders exactly that (the same text,
tokenized the same way), and splits the ids into one span per message (template tokens included) by rendering the
messages incrementally: messages[:k] must render to a prefix of messages[:k+1], as chat templates do; one that does not
is refused with the message it broke at. The tail after the last message is the generation prompt.

Segments follow messages: a message rendered to the same ids in several calls is one segment, shared when several
agents read it. A message whose ids differ between calls (context-dependent tokenization, or a template that renders
a message differently by position) keeps each call's exact ids in a segment of its own, and the difference is
recorded (`ChatSegments.differences`) — never silently merged. An earlier output read back as an assistant message is
stored as the generation prompt and output segments that produced it (plus any tail the template adds, e.g. an
end-of-turn token) when its rendering starts with exactly those ids, so the shared timeline stays one growing
sequence; otherwise it is a message segment of its own, recorded as a difference.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.trace import Segment

PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""Messages as their contents back to back, no template tokens: how a log is rendered for a tokenizer without a chat
template (`import-chat --chat-template auto` or `off`)."""


@dataclass(frozen=True)
class Message:
    """One chat message; `name` tells which agent wrote an assistant message."""

    role: str
    content: str
    name: str | None = None

    def as_dict(self) -> dict:
        entry = {"role": self.role, "content": self.content}
        if self.name is not None:
            entry["name"] = self.name
        return entry


def template_sha256(template: str) -> str:
    return "sha256:" + hashlib.sha256(template.encode()).hexdigest()[:32]


def resolve_chat_template(choice: str, tokenizer) -> str | None:
    """`--chat-template`: auto (the tokenizer's template when it has one, else kvprof's own layout), on (the
    tokenizer's, required), off (kvprof's own layout) or the path of a Jinja template file. Returns the template
    text, or None for kvprof's layout."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if choice == "off":
        return None
    if choice == "auto":
        return own or None
    if choice == "on":
        if not own:
            raise KvprofError(
                f"--chat-template on, but tokenizer {tokenizer.name_or_path!r} has no chat template; pass "
                "--chat-template FILE with a Jinja template, or --chat-template off for kvprof's own layout."
            )
        return own
    path = Path(choice)
    if not path.is_file():
        raise KvprofError(
            f"--chat-template {choice!r} is neither auto, on, off nor a template file; pass one of those."
        )
    return path.read_text(encoding="utf-8")


class ChatFormat:
    """Renders messages with one chat template and one tokenizer (see module docstring)."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template

    def text(self, messages: list[Message], generation_prompt: bool = False) -> str:
        """The text `apply_chat_template` renders for `messages`."""
        try:
            return self.tokenizer.apply_chat_template(
                [message.as_dict() for message in messages],
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as err:  # jinja errors, templates that raise on roles they do not know
            raise KvprofError(
                f"the chat template could not render these messages ({type(err).__name__}: {err}); use a template "
                "that knows the roles system, user, assistant and tool, or --chat-template off."
            ) from None

    def ids(self, messages: list[Message], generation_prompt: bool = False) -> list[int]:
        """The token ids `apply_chat_template` gives for `messages` (its text, tokenized without special tokens)."""
        return self.tokenizer.encode(self.text(messages, generation_prompt), add_special_tokens=False)

    def spans(self, messages: list[Message]) -> tuple[list[list[int]], list[int]]:
        """Per message its ids in this call, and the generation prompt's ids; their concatenation is the call's
        input exactly as `apply_chat_template(messages, add_generation_prompt=True)` tokenizes it.

        The call's text is tokenized once; each token belongs to the message whose rendered text it starts in
        (messages[:k] must render to a text prefix of messages[:k+1]). A token that merges text across a boundary
        therefore counts for the message it starts in, and that message's or the next one's ids can differ from
        another call's: the caller records such differences."""
        ends, done = [], ""
        for count in range(1, len(messages) + 1):
            rendered = self.text(messages[:count])
            if not rendered.startswith(done):
                raise KvprofError(
                    f"the chat template does not render messages incrementally: adding message {count} "
                    f"({messages[count - 1].role}) changes the text of the messages before it; kvprof needs each "
                    "message's text to stay put — use --chat-template off."
                )
            ends.append(len(rendered))
            done = rendered
        full = self.text(messages, generation_prompt=True)
        if not full.startswith(done):
            raise KvprofError(
                "the chat template's generation prompt changes the text of the messages before it; kvprof needs it "
                "to stay put — use --chat-template off."
            )
        encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        spans: list[list[int]] = [[] for _ in range(len(messages) + 1)]
        for token, (begin, _) in zip(encoding["input_ids"], encoding["offset_mapping"]):
            spans[bisect.bisect_right(ends, begin)].append(token)
        return spans[:-1], spans[-1]


@dataclass
class Difference:
    """A message that rendered to different ids in two calls: where it first appeared and where it differs."""

    message: Message
    first_call: int
    call: int
    first_ids: list[int]
    ids: list[int]

    def describe(self) -> str:
        content = self.message.content.strip().replace("\n", " ")
        content = content if len(content) <= 40 else content[:37] + "..."
        at = next((i for i, (a, b) in enumerate(zip(self.first_ids, self.ids)) if a != b), None)
        where = f"token {at}" if at is not None else f"length {len(self.first_ids)} vs {len(self.ids)}"
        return (
            f"{self.message.role} message {content!r} renders differently in call {self.call} than in call "
            f"{self.first_call} ({where}); each call keeps its own ids"
        )


@dataclass
class ChatSegments:
    """Builds the segments of one trajectory from rendered calls (see module docstring).

    format: renders the calls; segments: id → `Segment`, the trajectory's; differences: messages whose ids changed
    between calls.
    """

    format: ChatFormat
    segments: dict[str, Segment] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)
    _by_message: dict[Message, list[tuple[str, list[int], int]]] = field(default_factory=dict)
    _outputs: dict[Message, list[str]] = field(default_factory=dict)
    _count: int = 0

    def _new(self, kind: str, scope: str, ids: list[int], text: str, producer: str | None = None) -> str:
        seg_id = f"{kind}:{self._count}"
        self._count += 1
        self.segments[seg_id] = Segment(kind=kind, scope=scope, tokens=list(ids), text=text, producer=producer)
        return seg_id

    def call(self, index: int, messages: list[Message], private: set[int]) -> tuple[list[str], str | None]:
        """Render call `index` (`private`: indices of messages only this agent reads, e.g. its role prompt) and
        return its input segment ids — the messages', then the generation prompt's — and the generation prompt's
        segment id (None when the template has none)."""
        spans, prompt = self.format.spans(messages)
        inputs = []
        for position, (message, ids) in enumerate(zip(messages, spans)):
            inputs += self._message(index, message, ids, "private" if position in private else "shared")
        if not prompt:
            return inputs, None
        prompt_segment = self._reuse(index, Message("generation", " ".join(map(str, prompt))), prompt, "shared")
        self.segments[prompt_segment].text = self.format.tokenizer.decode(prompt)
        return inputs + [prompt_segment], prompt_segment

    def _message(self, index: int, message: Message, ids: list[int], scope: str) -> list[str]:
        if not ids:  # every token of its text merged into a token that starts in the message before
            renderings = self._by_message.setdefault(message, [])
            if renderings and all(known for _, known, _ in renderings):
                self.differences.append(Difference(message, renderings[0][2], index, renderings[0][1], ids))
                renderings.append(("", [], index))
            return []
        produced = self._outputs.get(message)
        if produced is not None:
            pieces = [tok for seg_id in produced for tok in self.segments[seg_id].tokens]
            if ids[: len(pieces)] == pieces:
                tail = ids[len(pieces) :]
                if not tail:
                    return produced
                return produced + [self._reuse(index, Message("tail", message.content, message.name), tail, scope)]
        return [self._reuse(index, message, ids, scope)]

    def _reuse(self, index: int, message: Message, ids: list[int], scope: str) -> str:
        """The segment of `message` rendered as `ids`: an earlier one with the same ids, else a new one (a new
        rendering of a known message is recorded as a difference, once)."""
        renderings = self._by_message.setdefault(message, [])
        for seg_id, known, _ in renderings:
            if known == ids:
                return seg_id
        if renderings:
            _, first_ids, first_call = renderings[0]
            self.differences.append(Difference(message, first_call, index, first_ids, ids))
        seg_id = self._new(_kind(message, scope), scope, ids, message.content, message.name)
        renderings.append((seg_id, ids, index))
        return seg_id

    def output(self, agent: str, ids: list[int], text: str, prompt_segment: str | None) -> tuple[str, Message]:
        """Record an agent's output; returns its segment id and the assistant message later calls read it as."""
        seg_id = self._new("output", "shared", ids, text, producer=agent)
        message = Message("assistant", text, agent)
        self._outputs[message] = ([prompt_segment] if prompt_segment else []) + [seg_id]
        return seg_id, message


def _kind(message: Message, scope: str) -> str:
    return {
        "system": "prompt" if scope == "private" else "system",
        "user": "question",
        "tool": "observation",
        "generation": "cue",
        "assistant": "message",
        "tail": "cue",
    }.get(message.role, "message")
