"""Agent traces exported from tracing stores (`kvprof.traces.stores`): one three-agent conversation, written from
each format's spec (`stores_conversation`), imports to the same turns' ids as the conversation's OpenAI chat log,
through the official Qwen 2.5 and Mistral Nemo templates; the template check flags every call rendered with another
template or without its tools and none rendered right; bad input is refused in one sentence naming the span, run,
line or row, exit 2, nothing written."""

from __future__ import annotations

import json
import sqlite3

import pytest
import stores_conversation as conv
from real_chat import FAMILIES
from transformers import AutoTokenizer

from kvprof.errors import KvprofError
from kvprof.model.agents import tokenizer_identity
from kvprof.model.tiny import build_tokenizer
from kvprof.traces.chat_log import import_calls, import_log
from kvprof.traces.stores.detect import detect, read_calls, resolve_format

TEMPLATE_FAMILIES = ("qwen2.5", "mistral-nemo")


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory):
    """A tiny tokenizer per family, with its special tokens and official chat template, saved as a model folder."""
    folders = {}
    for name in TEMPLATE_FAMILIES:
        family = FAMILIES[name]
        tokenizer = build_tokenizer()
        tokens: dict = {"additional_special_tokens": list(family.special), "eos_token": family.eos}
        if family.bos is not None:
            tokens["bos_token"] = family.bos
        tokenizer.add_special_tokens(tokens)
        tokenizer.add_tokens(list(family.plain))
        tokenizer.chat_template = family.template_text
        folders[name] = tmp_path_factory.mktemp(name)
        tokenizer.save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module")
def tokenizers(tokenizer_folders):
    return {name: AutoTokenizer.from_pretrained(folder) for name, folder in tokenizer_folders.items()}


def counts(tokenizer, lines: list[dict]) -> list[int]:
    """Each call's input token count as a server with the family's template (and the call's tools) records it."""
    rendered = [
        tokenizer.apply_chat_template(
            line["messages"], tools=line.get("tools"), add_generation_prompt=True, tokenize=False
        )
        for line in lines
    ]
    return [len(tokenizer.encode(text, add_special_tokens=False)) for text in rendered]


def turns(imported) -> list[tuple]:
    return [
        (traj.id, turn.agent, traj.input_tokens(turn), traj.output_tokens(turn))
        for traj in imported.trace.trajectories
        for turn in traj.turns
    ]


def import_store(path, tokenizer, family: str, fmt: str | None = None):
    store = read_calls(path, fmt or detect(path))
    template = FAMILIES[family].template_text
    return store, import_calls(path, store.calls, tokenizer, template, tokenizer_identity(tokenizer), family)


def import_reference(tmp_path, tokenizer, family: str, tools: bool = True):
    path = conv.write_jsonl(conv.records(tools=tools), tmp_path / f"reference-{tools}.jsonl")
    return import_log(path, tokenizer, FAMILIES[family].template_text, tokenizer_identity(tokenizer), family)


EXPORTS = {  # name: (format detected, whether the export holds the tool definitions, writer(lines, counts, path))
    "genai-span-json": ("otlp", True, lambda lines, n, p: conv.write_genai(lines, n, p)),
    "genai-event-structured": ("otlp", True, lambda lines, n, p: conv.write_genai(lines, n, p, True, False)),
    "genai-deprecated-attributes": ("otlp", False, lambda lines, n, p: conv.write_genai_deprecated(lines, p, False)),
    "genai-deprecated-events": ("otlp", False, lambda lines, n, p: conv.write_genai_deprecated(lines, p, True)),
    "openinference": ("openinference", True, conv.write_openinference),
    "langsmith": ("langsmith", True, conv.write_langsmith),
    "agents-sdk-generations": (
        "agents-sdk",
        False,
        lambda lines, n, p: conv.write_agents_sdk(lines, n, p, conv.generation_data(n)),
    ),
    "agents-sdk-responses": (
        "agents-sdk",
        True,
        lambda lines, n, p: conv.write_agents_sdk(lines, n, p, conv.response_data(n)),
    ),
    "ag2": ("ag2", True, conv.write_ag2),
}


@pytest.mark.parametrize("family", TEMPLATE_FAMILIES)
@pytest.mark.parametrize("export", EXPORTS)
def test_each_export_imports_to_the_chat_logs_ids(tokenizers, tmp_path, family, export):
    """The Agents SDK's generation spans and the deprecated GenAI attributes hold no tool definitions: their calls
    equal the chat log without tools, and the template check flags each (the recorded count had them)."""
    fmt, has_tools, write = EXPORTS[export]
    tokenizer = tokenizers[family]
    lines = conv.records()
    path = write(lines, counts(tokenizer, lines), tmp_path / f"{export}.export")
    assert detect(path) == fmt
    store, imported = import_store(path, tokenizer, family)
    assert not store.missing
    reference = import_reference(tmp_path, tokenizer, family, tools=has_tools)
    assert turns(imported) == turns(reference)
    assert [c.agent for c in store.calls] == ["triage", "researcher", "researcher", "writer"]
    if export not in ("openinference", "genai-deprecated-events"):  # their specs have no field for reasoning
        assert store.calls[3].messages[-1].reasoning_content == conv.REASONING
    flagged = imported.mismatches
    if has_tools or export.startswith("genai-deprecated"):  # the deprecated writers record no usage
        assert flagged == []
    else:
        assert len(flagged) == 4 and all("tool definitions missing" in m.cause() for m in flagged)


@pytest.mark.parametrize("export", ["genai-span-json", "openinference", "langsmith", "agents-sdk-responses", "ag2"])
def test_template_check_flags_every_call_of_a_wrong_template_or_missing_tools(tokenizers, tmp_path, export):
    """Counts recorded by a Qwen 2.5 server: rendered with Mistral's template every call differs (cause: another
    template); exported without the tools every call differs (cause: tool definitions missing); right, none."""
    fmt, _, write = EXPORTS[export]
    lines = conv.records()
    recorded = counts(tokenizers["qwen2.5"], lines)
    right = write(lines, recorded, tmp_path / "right.export")
    assert import_store(right, tokenizers["qwen2.5"], "qwen2.5")[1].mismatches == []
    wrong = import_store(right, tokenizers["mistral-nemo"], "mistral-nemo")[1].mismatches
    assert len(wrong) == 4 and all("another chat template" in m.cause() for m in wrong)
    bare = write(conv.records(tools=False), recorded, tmp_path / "bare.export")
    missing = import_store(bare, tokenizers["qwen2.5"], "qwen2.5")[1].mismatches
    assert [m.where for m in missing] == [c.where for c in read_calls(bare, fmt).calls]
    assert len(missing) == 4 and all("tool definitions missing" in m.cause() for m in missing)


def test_strict_refuses_a_log_the_template_check_flags(tokenizer_folders, tokenizers, tmp_path, run_cli):
    lines = conv.records()
    path = conv.write_genai(conv.records(tools=False), counts(tokenizers["qwen2.5"], lines), tmp_path / "t.json")
    model = tokenizer_folders["qwen2.5"]
    code, out, err = run_cli("import-chat", path, "--model", model, "--strict", "--out", tmp_path / "strict")
    assert code == 2 and "4 of 4 calls" in err and "span 0000000100000001" in err and "Traceback" not in err
    assert not (tmp_path / "strict" / "trace.jsonl").exists()
    code, out, err = run_cli("import-chat", path, "--model", model, "--out", tmp_path / "o")
    assert code == 0, err
    assert "read as OTLP JSON with the OpenTelemetry GenAI conventions (detected otlp)" in out
    assert "template check: 4 of 4 calls" in out
    result = json.loads((tmp_path / "o" / "import-chat.json").read_text())
    assert result["format"] == "otlp" and len(result["token_count_mismatches"]) == 4
    assert [call["where"] for call in result["calls"]][0] == "span 0000000100000001"


def test_calls_without_content_are_left_out_and_reported(tokenizers, tmp_path):
    """Content capture off on one span (no messages), and a response continuing one the export lacks: each left
    out, reported per trajectory with the setting that records it; the others import."""
    lines = conv.records()
    path = conv.write_genai(lines, None, tmp_path / "t.json")
    export = json.loads(path.read_text())
    spans = export["resourceSpans"][0]["scopeSpans"][0]["spans"]
    first = next(s for s in spans if s["name"] == "chat m")
    first["attributes"] = [
        a for a in first["attributes"] if not a["key"].startswith("gen_ai.") or "operation" in a["key"]
    ]
    path.write_text(json.dumps(export))
    store = read_calls(path, "otlp")
    assert len(store.calls) == 3 and [m.where for m in store.missing] == ["span 0000000100000001"]
    (sentence,) = store.missing_report()
    assert sentence.startswith("trajectory 'conv-1': 1 calls left out (no input messages (content capture off)")
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true" in sentence
    sdk = conv.write_agents_sdk(lines, None, tmp_path / "sdk.json", conv.response_data(None))
    payload = json.loads(sdk.read_text())
    payload["data"] = [d for d in payload["data"] if d["id"] != "span_g1"]  # the response call 2 continues
    sdk.write_text(json.dumps(payload))
    store = read_calls(sdk, "agents-sdk")
    assert [(m.where, m.what) for m in store.missing] == [
        ("span span_g2", "continues response resp_1, which the export does not hold")
    ]
    assert len(store.calls) == 2


def _otlp_spans(path):
    export = json.loads(path.read_text())
    return export, export["resourceSpans"][0]["scopeSpans"][0]["spans"]


def _edit_otlp(path, edit):
    export, spans = _otlp_spans(path)
    edit(spans)
    path.write_text(json.dumps(export))


def _attribute(span: dict, key: str) -> dict:
    return next(a for a in span["attributes"] if a["key"] == key)


def _cycle(spans):
    spans[0]["parentSpanId"] = spans[-1]["spanId"]  # the workflow root under the last chat span


def _no_parent(spans):
    spans[2]["parentSpanId"] = "00000000deadbeef"


def _not_json(spans):
    _attribute(spans[2], "gen_ai.input.messages")["value"] = {"stringValue": "[{'role': 'user'"}


def _unknown_part(spans):
    messages = json.loads(_attribute(spans[2], "gen_ai.input.messages")["value"]["stringValue"])
    messages[0]["parts"].append({"type": "blob", "modality": "image", "content": "aGVsbG8="})
    _attribute(spans[2], "gen_ai.input.messages")["value"] = {"stringValue": json.dumps(messages)}


def _runs_edit(edit):
    def apply(path):
        runs = [json.loads(line) for line in path.read_text().splitlines()]
        edit(runs)
        path.write_text("".join(json.dumps(run) + "\n" for run in runs))

    return apply


def _sdk_edit(edit):
    def apply(path):
        payload = json.loads(path.read_text())
        edit(payload["data"])
        path.write_text(json.dumps(payload))

    return apply


def _empty_table(path):
    connection = sqlite3.connect(path)
    connection.execute("DELETE FROM chat_completions")
    connection.commit()
    connection.close()


def _no_table(path):
    connection = sqlite3.connect(path)
    connection.execute("DROP TABLE chat_completions")
    connection.execute("CREATE TABLE other (id INTEGER)")
    connection.commit()
    connection.close()


def _bad_request(path):
    connection = sqlite3.connect(path)
    connection.execute("UPDATE chat_completions SET request = '{\"messages\": [' WHERE id = 2")
    connection.commit()
    connection.close()


def _oi_unknown(spans):
    _attribute(spans[2], "llm.input_messages.1.message.content")["key"] = (
        "llm.input_messages.1.message.contents.0.message_content.text"
    )
    spans[2]["attributes"].append(
        {"key": "llm.input_messages.1.message.contents.0.message_content.type", "value": {"stringValue": "image"}}
    )


BAD = {  # name: (export, how it is broken, what the refusal says)
    "otlp-cycle": ("genai-span-json", lambda p: _edit_otlp(p, _cycle), "span 00000000000000aa: is its own ancestor"),
    "otlp-missing-parent": (
        "genai-span-json",
        lambda p: _edit_otlp(p, _no_parent),
        "span 0000000100000001: names a parent span the export does not hold",
    ),
    "otlp-not-json": (
        "genai-span-json",
        lambda p: _edit_otlp(p, _not_json),
        "span 0000000100000001: has gen_ai.input.messages that is not JSON",
    ),
    "otlp-unknown-part": (
        "genai-span-json",
        lambda p: _edit_otlp(p, _unknown_part),
        "span 0000000100000001: has a message part of type 'blob'",
    ),
    "otlp-empty": ("genai-span-json", lambda p: p.write_text('{"resourceSpans": []}'), "holds no spans"),
    "openinference-unknown-content": (
        "openinference",
        lambda p: _edit_otlp(p, _oi_unknown),
        "span 0000000100000001: has message content of type 'image'",
    ),
    "langsmith-cycle": (
        "langsmith",
        _runs_edit(lambda runs: runs[0].update(parent_run_id=runs[-1]["id"])),
        "is its own ancestor",
    ),
    "langsmith-missing-parent": (
        "langsmith",
        _runs_edit(lambda runs: runs[2].update(parent_run_id="lost")),
        "run 00000000-0000-0000-0000-000000000002: names a parent run",
    ),
    "langsmith-not-json": ("langsmith", lambda p: p.write_text(p.read_text() + "{not json\n"), "line 10: is not JSON"),
    "langsmith-empty": ("langsmith", lambda p: p.write_text("[]"), "holds no runs"),
    "agents-sdk-cycle": (
        "agents-sdk-responses",
        _sdk_edit(lambda data: data[1].update(parent_id="span_g0")),
        "span span_a0: is its own ancestor",
    ),
    "agents-sdk-missing-parent": (
        "agents-sdk-responses",
        _sdk_edit(lambda data: data[2].update(parent_id="span_lost")),
        "span span_g0: names a parent span",
    ),
    "agents-sdk-unknown-item": (
        "agents-sdk-responses",
        _sdk_edit(lambda data: data[2]["span_data"]["input"].append({"type": "image_generation_call"})),
        "span span_g0: has an item of type 'image_generation_call'",
    ),
    "agents-sdk-empty": ("agents-sdk-responses", lambda p: p.write_text('{"data": []}'), "holds no spans"),
    "ag2-no-table": ("ag2", _no_table, "has no table chat_completions"),
    "ag2-empty": ("ag2", _empty_table, "holds no model calls"),
    "ag2-not-json": ("ag2", _bad_request, "row 2: has a request that is not JSON"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_exports_are_refused_naming_the_place(tokenizer_folders, tmp_path, run_cli, case):
    export, breaking, expected = BAD[case]
    fmt, _, write = EXPORTS[export]
    path = write(conv.records(), None, tmp_path / "bad.export")
    breaking(path)
    model = tokenizer_folders["qwen2.5"]
    code, _, err = run_cli("import-chat", path, "--model", model, "--format", fmt, "--out", tmp_path / "o")
    assert code == 2 and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.count(". ") == 0  # one sentence
    assert not (tmp_path / "o").exists()


def test_what_no_store_marks_is_read_as_a_chat_log(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}\n')
    assert detect(path) == "chat"
    with pytest.raises(KvprofError, match="line 1: has no str field 'agent'"):
        read_calls(path, "chat")
    with pytest.raises(KvprofError, match="--format 'otel' is not a format kvprof reads; pass auto or one of chat"):
        resolve_format(path, "otel")


def test_the_demo_otlp_export_imports_as_its_chat_log(tmp_path):
    """The demo world's OTLP export (`kvprof.demo.otlp_log`) imports to the turns of the chat log it was written from,
    and every call's recorded input token count matches the rendering."""
    from kvprof.demo.assets import demo_world

    world = demo_world()
    tokenizer = AutoTokenizer.from_pretrained(world.model)
    template = world.chat_template.read_text(encoding="utf-8")
    identity = tokenizer_identity(tokenizer)
    reference = import_log(world.sample_chat_log, tokenizer, template, identity, "demo")
    store = read_calls(world.sample_otlp_log, detect(world.sample_otlp_log))
    imported = import_calls(world.sample_otlp_log, store.calls, tokenizer, template, identity, "demo", source="otlp")
    assert store.format == "otlp" and not store.missing and len(store.calls) == 28
    assert turns(imported) == turns(reference) and imported.mismatches == []


def test_a_log_without_tool_use_blames_the_template_not_missing_tools():
    """A longer recorded prompt without tool definitions: tools missing where the log's agents use tools, another
    template where they never do."""
    from kvprof.traces.token_counts import mismatch

    uses = mismatch("span 1", "t", "plan", 30, 32, has_tools=False, log_uses_tools=True)
    never = mismatch("span 1", "t", "plan", 30, 32, has_tools=False, log_uses_tools=False)
    assert uses is not None and "tool definitions missing" in uses.cause()
    assert never is not None and never.cause().startswith("another chat template")
