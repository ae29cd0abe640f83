"""Agent calls as chat messages, rendered through a chat template into the segments of a trajectory.

A call's input ids are exactly `tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)`;
only the cut into segments is derived, and it decides only what can be shared: one segment per message for
incremental templates, else contents located in the rendering with template "glue" segments (kind `cue`) between
them. Ids that change between calls, and replies read back differently from their generated ids, are recorded
(`ChatSegments.differences`). The rules: docs/commands/import-chat.md.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import read_text_file
from kvprof.traces.trace import Segment

PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""Messages as their contents back to back, no template tokens: how a log is rendered for a tokenizer without a chat
template (`import-chat --chat-template auto` or `off`)."""


@dataclass(frozen=True)
class Message:
    """One OpenAI-format chat message, hashable: `name` (agent or tool), `tool_calls` as canonical JSON text (a list
    in `as_dict`), `tool_call_id`; `content` None for a message that only calls tools; `reasoning_content` an
    assistant's reasoning as vLLM passes it to templates (those that show earlier reasoning read it)."""

    role: str
    content: str | None
    name: str | None = None
    tool_calls: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @classmethod
    def of(
        cls,
        role: str,
        content: str | None,
        name: str | None = None,
        tool_calls: list | None = None,
        tool_call_id: str | None = None,
        reasoning_content: str | None = None,
    ) -> Message:
        """A message with `tool_calls` as the OpenAI list (stored as JSON, key order kept as `tojson` keeps it)."""
        calls = None if tool_calls is None else json.dumps(tool_calls, ensure_ascii=False, separators=(",", ":"))
        return cls(role, content, name, calls, tool_call_id, reasoning_content)

    @property
    def text(self) -> str:
        """The content, or the tool calls' JSON for a message without content (for reading traces)."""
        return self.content if self.content is not None else (self.tool_calls or "")

    def as_dict(self) -> dict:
        """The message as the template gets it."""
        entry: dict = {"role": self.role, "content": self.content}
        if self.name is not None:
            entry["name"] = self.name
        if self.tool_calls is not None:
            entry["tool_calls"] = json.loads(self.tool_calls)
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            entry["reasoning_content"] = self.reasoning_content
        return entry


def template_sha256(template: str) -> str:
    return "sha256:" + hashlib.sha256(template.encode()).hexdigest()[:32]


def resolve_chat_template(choice: str, tokenizer) -> str | None:
    """`--chat-template` auto / on / off / a Jinja file → the template text, or None for kvprof's own layout."""
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
    if not path.exists():
        raise KvprofError(
            f"--chat-template {choice!r} is neither auto, on, off nor a template file; pass one of those."
        )
    return read_text_file(path, "chat template", "pass a Jinja chat template file, or auto, on or off")


@dataclass
class Piece:
    """Characters [start, end) of a rendered call and the `ids` starting there; `part`: "message" (incremental),
    "glue" (before message `message`'s content), "content", or "tail" (the generation prompt)."""

    part: str
    message: int | None
    start: int
    end: int
    ids: list[int] = field(default_factory=list)


@dataclass
class Rendering:
    """One rendered call: text, ids, pieces (in order, ids concatenating to `ids`), each content's location (or
    None), generation prompt text ('' if none)."""

    text: str
    ids: list[int]
    starts: list[int]
    pieces: list[Piece]
    contents: list[tuple[int, int] | None]
    generation: str
    incremental: bool

    def first_token(self, char: int) -> int:
        """The index of the first token that starts at or after character `char`."""
        return bisect.bisect_left(self.starts, char)


class ChatFormat:
    """Renders messages with one chat template and one tokenizer (see module docstring)."""

    def __init__(self, tokenizer, template: str):
        self.tokenizer, self.template = tokenizer, template

    def text(self, messages: list[Message], generation_prompt: bool = False, tools: list | None = None) -> str:
        """The text `apply_chat_template` renders for `messages` (and `tools`, the call's function schemas)."""
        try:
            return self.tokenizer.apply_chat_template(
                [message.as_dict() for message in messages],
                tools=tools,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        except Exception as err:  # jinja errors, templates that raise on roles or shapes they do not take
            raise KvprofError(
                f"the chat template could not render these messages ({type(err).__name__}: {err}); log them in a "
                "shape the template takes (the roles and alternation it expects), or use --chat-template off."
            ) from None

    def ids(self, messages: list[Message], generation_prompt: bool = False, tools: list | None = None) -> list[int]:
        """The token ids `apply_chat_template` gives for `messages` (its text, tokenized without special tokens)."""
        return self.tokenizer.encode(self.text(messages, generation_prompt, tools), add_special_tokens=False)

    def render(self, messages: list[Message], tools: list | None = None) -> Rendering:
        """The call rendered with its generation prompt and split into pieces (see module docstring)."""
        full = self.text(messages, generation_prompt=True, tools=tools)
        encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        starts = [begin for begin, _ in encoding["offset_mapping"]]
        ends = self._incremental_ends(messages, tools, full)
        if ends is not None:
            bounds = [0, *ends]
            contents = [_locate(full, m, bounds[k], bounds[k + 1]) for k, m in enumerate(messages)]
            # a content found in the call but outside its message's part: the template moved it (Gemma's system)
            if not any(found is None and _locate(full, m) for found, m in zip(contents, messages)):
                pieces = [Piece("message", k, bounds[k], bounds[k + 1]) for k in range(len(messages))]
                pieces.append(Piece("tail", None, ends[-1] if ends else 0, len(full)))
                _fill(pieces, ids, starts)
                return Rendering(full, ids, starts, pieces, contents, full[bounds[-1] :], True)
        contents = _align(full, messages)
        pieces, cursor = [], 0
        for (begin, end), k in sorted((found, k) for k, found in enumerate(contents) if found is not None):
            if begin > cursor:
                pieces.append(Piece("glue", k, cursor, begin))
            pieces.append(Piece("content", k, begin, end))
            cursor = end
        pieces.append(Piece("tail", None, cursor, len(full)))
        _fill(pieces, ids, starts)
        return Rendering(full, ids, starts, pieces, contents, self._generation(messages, tools, full), False)

    def _incremental_ends(self, messages: list[Message], tools: list | None, full: str) -> list[int] | None:
        """Each message's text end when the template is incremental, else None."""
        ends, done = [], ""
        for count in range(1, len(messages) + 1):
            try:
                rendered = self.text(messages[:count], tools=tools)
            except KvprofError:
                return None
            if not rendered.startswith(done):
                return None
            ends.append(len(rendered))
            done = rendered
        return ends if full.startswith(done) else None

    def _generation(self, messages: list[Message], tools: list | None, full: str) -> str:
        try:
            bare = self.text(messages, tools=tools)
        except KvprofError:
            return ""
        return full[len(bare) :] if full.startswith(bare) else ""

    def spans(self, messages: list[Message], tools: list | None = None) -> tuple[list[list[int]], list[int]]:
        """Per message its ids (template text included) and the generation prompt's, concatenating to the call's
        exact ids; refuses out-of-order renderings."""
        rendering = self.render(messages, tools)
        spans: list[list[int]] = [[] for _ in messages]
        order = [piece.message for piece in rendering.pieces if piece.message is not None]
        if order != sorted(order):
            raise KvprofError(
                "the chat template renders these messages out of their order (e.g. the system prompt inside the last "
                "user message), so they have no spans one after another; render the whole call instead."
            )
        prompt: list[int] = []
        for piece in rendering.pieces:
            if piece.message is None:
                prompt = piece.ids
            else:
                spans[piece.message] += piece.ids
        return spans, prompt


def _needle(message: Message) -> str:
    """The text of a message that must be found in its rendering (none for a content-less message)."""
    return (message.content or "") if (message.content or "").strip() else ""


def _locate(text: str, message: Message, begin: int = 0, end: int | None = None) -> tuple[int, int] | None:
    """Where `message`'s content is in text[begin:end]: as given, else stripped (templates that `| trim`)."""
    needle = _needle(message)
    if not needle:
        return None
    for candidate in (needle, needle.strip()):
        at = text.find(candidate, begin, end)
        if at >= 0:
            return at, at + len(candidate)
    return None


def _align(text: str, messages: list[Message]) -> list[tuple[int, int] | None]:
    """Each content's location (or None): the in-order assignment covering most characters, then moved messages
    (e.g. a system prompt in the last user message) where no other content lies."""
    needles = []
    for message in messages:
        needle = _needle(message)
        needles.append(next((c for c in (needle, needle.strip()) if needle and c in text), ""))
    # Pareto front of (cursor, covered, chain): a larger cursor must cover more to be worth keeping.
    front: list[tuple[int, int, tuple | None]] = [(0, 0, None)]
    for k, needle in enumerate(needles):
        if not needle:
            continue
        grown = list(front)
        for cursor, covered, chain in front:
            at = text.find(needle, cursor)
            if at >= 0:
                grown.append((at + len(needle), covered + len(needle), (k, at, chain)))
        grown.sort(key=lambda state: (state[0], -state[1]))
        front = []
        for state in grown:
            if not front or state[1] > front[-1][1]:
                front.append(state)
    contents: list[tuple[int, int] | None] = [None] * len(messages)
    chain = max(front, key=lambda state: state[1])[2]
    while chain is not None:
        k, at, chain = chain
        contents[k] = (at, at + len(needles[k]))
    for k, needle in enumerate(needles):
        if needle and contents[k] is None:
            contents[k] = _uncovered_occurrence(text, needle, [c for c in contents if c is not None])
    return contents


def _uncovered_occurrence(text: str, needle: str, taken: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The first occurrence of `needle` in `text` that overlaps none of the `taken` (begin, end) ranges."""
    at = text.find(needle)
    while at >= 0:
        if all(at + len(needle) <= begin or at >= end for begin, end in taken):
            return at, at + len(needle)
        at = text.find(needle, at + 1)
    return None


def _fill(pieces: list[Piece], ids: list[int], starts: list[int]) -> None:
    """Give each piece the tokens that start in it (pieces cover the text in order)."""
    bounds = [piece.start for piece in pieces]
    for token, begin in zip(ids, starts):
        pieces[max(bisect.bisect_right(bounds, begin) - 1, 0)].ids.append(token)


@dataclass
class Difference:
    """A message with other ids than in `first_call` (`producer` None), or a reply read back differently from the
    `first_ids` `producer` generated (`ids`: what the reader has; `also`: later lines alike); lines None outside a
    log."""

    message: Message
    first_call: int
    call: int
    first_ids: list[int]
    ids: list[int]
    line: int | None = None
    first_line: int | None = None
    agent: str | None = None
    producer: str | None = None
    detail: str = ""
    also: list[int] = field(default_factory=list)

    def where(self) -> str:
        if self.detail:
            return self.detail
        at = next((i for i, (a, b) in enumerate(zip(self.first_ids, self.ids)) if a != b), None)
        return f"token {at}" if at is not None else f"length {len(self.first_ids)} vs {len(self.ids)}"

    def describe(self) -> str:
        if self.producer is not None:
            reader = f"line {self.line}: agent {self.agent!r}" if self.line is not None else f"call {self.call}"
            source = f"line {self.first_line}" if self.first_line is not None else f"call {self.first_call}"
            text = f"{reader} reads the reply of {source} ({self.producer}) differently from its generated ids "
            text += f"({self.where()})"
            if self.also:
                text += f"; so do lines {', '.join(map(str, self.also))}"
            return text
        content = self.message.text.strip().replace("\n", " ")
        content = content if len(content) <= 40 else content[:37] + "..."
        if self.line is not None:
            return (
                f"line {self.line}: {self.message.role} message {content!r} renders differently than in line "
                f"{self.first_line} ({self.where()}); each call keeps its own ids"
            )
        return (
            f"{self.message.role} message {content!r} renders differently in call {self.call} than in call "
            f"{self.first_call} ({self.where()}); each call keeps its own ids"
        )


@dataclass
class Reply:
    """A recorded output: author, call, ids, generation prompt, and its segments."""

    agent: str
    call: int
    line: int | None
    ids: list[int]
    generation: str
    segments: list[str]


@dataclass
class ChatSegments:
    """Builds one trajectory's `segments` (id → `Segment`) and `differences` from calls rendered by `format`."""

    format: ChatFormat
    segments: dict[str, Segment] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)
    _by_message: dict[tuple[str, Message], list[tuple[str, list[int], int]]] = field(default_factory=dict)
    _replies: dict[str, list[Reply]] = field(default_factory=dict)
    _read_backs: dict[tuple, Difference] = field(default_factory=dict)
    _lines: dict[int, int | None] = field(default_factory=dict)
    _last: tuple[int, str] = (0, "")
    _count: int = 0

    def _new(self, kind: str, scope: str, ids: list[int], text: str, producer: str | None = None) -> str:
        seg_id = f"{kind}:{self._count}"
        self._count += 1
        self.segments[seg_id] = Segment(kind=kind, scope=scope, tokens=list(ids), text=text, producer=producer)
        return seg_id

    def call(
        self,
        index: int,
        messages: list[Message],
        private: set[int],
        tools: list | None = None,
        line: int | None = None,
        agent: str | None = None,
    ) -> tuple[list[str], str | None]:
        """Render call `index` (`private`: messages only `agent` reads); its input segment ids (exactly the call's
        ids) and the generation prompt's (or None)."""
        rendering = self.format.render(messages, tools)
        self._lines[index] = line
        self._last = (index, rendering.generation)
        replies = [self._reply_of(message, index) for message in messages]
        inputs: list[str] = []
        prompt_segment = None
        before = -1  # the message whose content came last
        for piece in rendering.pieces:
            k = piece.message
            if k is None:  # the tail: the generation prompt
                if piece.ids:
                    key = Message("generation", " ".join(map(str, piece.ids)))
                    prompt_segment = self._reuse(index, ("generation", key), piece.ids, "shared")
                    self.segments[prompt_segment].text = self.format.tokenizer.decode(piece.ids)
                    inputs.append(prompt_segment)
                continue
            private_text = k in private or (  # glue also holds the text of private messages left unaligned
                piece.part == "glue" and any(rendering.contents[j] is None and before < j < k for j in private)
            )
            scope = "private" if private_text else "shared"
            part = f"{piece.part}:private:{agent}" if private_text else piece.part  # never another agent's segment
            if piece.part == "glue":
                if piece.ids:
                    key = Message("glue", rendering.text[piece.start : piece.end])
                    inputs.append(self._reuse(index, (part, key), piece.ids, scope, record=False))
            elif not piece.ids:
                self._empty(index, part, messages[k])
            else:
                inputs += self._message(index, part, messages[k], piece.ids, scope, replies[k])
            before = k
        for k, reply in enumerate(replies):
            if reply is not None:
                self._read_back(index, agent, messages[k], rendering, rendering.contents[k], reply)
        return inputs, prompt_segment

    def _reply_of(self, message: Message, index: int) -> Reply | None:
        """The latest earlier reply whose text (exact, else stripped) and agent `message` matches."""
        if message.role not in ("assistant", "user") or not _needle(message):
            return None
        for key in (message.content, (message.content or "").strip()):
            found = [
                reply
                for reply in self._replies.get(key or "", [])
                if reply.call < index and message.name in (None, reply.agent)
            ]
            if found:
                return found[-1]
        return None

    def _empty(self, index: int, part: str, message: Message) -> None:
        """A message with no token of its own (merged): a difference if it had tokens before."""
        renderings = self._by_message.setdefault((part, message), [])
        if renderings and all(known for _, known, _ in renderings):
            self._differ(message, renderings[0], index, [])
            renderings.append(("", [], index))

    def _message(
        self, index: int, part: str, message: Message, ids: list[int], scope: str, reply: Reply | None
    ) -> list[str]:
        if reply is not None:
            for produced in (reply.segments, reply.segments[-1:]):  # with its generation prompt, or the output alone
                pieces = [tok for seg_id in produced for tok in self.segments[seg_id].tokens]
                if ids[: len(pieces)] == pieces:
                    tail = ids[len(pieces) :]
                    if not tail:
                        return list(produced)
                    key = Message("tail", message.text, message.name)
                    return [*produced, self._reuse(index, ("tail", key), tail, scope)]
        return [self._reuse(index, (part, message), ids, scope, record=reply is None)]

    def _reuse(self, index: int, key: tuple[str, Message], ids: list[int], scope: str, record: bool = True) -> str:
        """The segment for `key` rendered as `ids`: an earlier one with those ids, else new (a difference, once, with
        `record`)."""
        renderings = self._by_message.setdefault(key, [])
        for seg_id, known, _ in renderings:
            if known == ids:
                return seg_id
        message = key[1]
        if renderings and record:
            self._differ(message, renderings[0], index, ids)
        seg_id = self._new(_kind(message, scope), scope, ids, message.text, message.name)
        renderings.append((seg_id, ids, index))
        return seg_id

    def _differ(self, message: Message, first: tuple[str, list[int], int], index: int, ids: list[int]) -> None:
        _, first_ids, first_call = first
        self.differences.append(
            Difference(
                message,
                first_call,
                index,
                first_ids,
                ids,
                line=self._lines.get(index),
                first_line=self._lines.get(first_call),
            )
        )

    def _read_back(
        self,
        index: int,
        agent: str | None,
        message: Message,
        rendering: Rendering,
        content: tuple[int, int] | None,
        reply: Reply,
    ) -> None:
        """Record `reply` read back differently by call `index` (other ids, or after another header)."""
        decode = self.format.tokenizer.decode
        if content is None:
            got, detail = [], "its text does not appear in the rendering"
        else:
            start = rendering.first_token(content[0])
            got = rendering.ids[start : start + len(reply.ids)]
            at = next((i for i, (a, b) in enumerate(zip(reply.ids, got)) if a != b), None)
            if at is not None:
                detail = f"token {at}: generated {decode([reply.ids[at]])!r}, read {decode([got[at]])!r}"
            elif len(got) < len(reply.ids):
                detail = f"token {len(got)}: generated {decode([reply.ids[len(got)]])!r}, read nothing"
            elif reply.generation and not rendering.text[: content[0]].endswith(reply.generation):
                before = bisect.bisect_left([piece.start for piece in rendering.pieces], content[0]) - 1
                preceding = rendering.text[rendering.pieces[before].start if before >= 0 else 0 : content[0]]
                detail = f"same ids, read after {preceding!r}, generated after {reply.generation!r}"
            else:
                return
        key = (reply.call, message.role, message.name, tuple(got), detail)
        known = self._read_backs.get(key)
        line = self._lines.get(index)
        if known is not None:
            if line is not None:
                known.also.append(line)
            return
        difference = Difference(
            message,
            reply.call,
            index,
            reply.ids,
            got,
            line=line,
            first_line=reply.line,
            agent=agent,
            producer=reply.agent,
            detail=detail,
        )
        self._read_backs[key] = difference
        self.differences.append(difference)

    def output(self, agent: str, ids: list[int], text: str, prompt_segment: str | None) -> tuple[str, Message]:
        """Record the last call's output: its segment id and the message later calls read."""
        seg_id = self._new("output", "shared", ids, text, producer=agent)
        index, generation = self._last
        segments = ([prompt_segment] if prompt_segment else []) + [seg_id]
        reply = Reply(agent, index, self._lines.get(index), list(ids), generation, segments)
        self._replies.setdefault(text, []).append(reply)
        if text.strip() != text:
            self._replies.setdefault(text.strip(), []).append(reply)
        return seg_id, Message("assistant", text, agent)


def _kind(message: Message, scope: str) -> str:
    if message.role == "user" and message.name is not None:  # another agent's message in a group chat
        return "message"
    return {
        "system": "prompt" if scope == "private" else "system",
        "user": "question",
        "tool": "observation",
        "generation": "cue",
        "assistant": "message",
        "tail": "cue",
        "glue": "cue",
    }.get(message.role, "message")
