"""The trace format: round trips, validation messages, tokenizer identity, shape-CSV import."""

from __future__ import annotations

import json

import pytest

from kvprof.errors import KvprofError
from kvprof.model.agents import load_tokenizer, tokenizer_identity
from kvprof.model.tiny import build_tokenizer
from kvprof.traces.shapes import import_shape_csv
from kvprof.traces.trace import check_tokenizer, read_header, read_trace, shared_segment_ids, write_trace

REACT_SHAPE = (
    [("plan", 512, 32)]
    + [("plan", 4096, 32), ("plan", 8, 8), ("action", 8, 8)] * 4
    + [("reflect", 32, 32), ("reflect", 8, 8)]
)


def test_round_trip_is_exact(lora_trace, tmp_path):
    trace = read_trace(lora_trace)
    copy = write_trace(tmp_path / "copy.jsonl", trace)
    assert copy.read_bytes() == lora_trace.read_bytes()


def test_tokens_retokenize_to_text(lora_trace, tiny_world):
    tokenizer = load_tokenizer(str(tiny_world.model))
    for traj in read_trace(lora_trace).trajectories:
        for seg_id, segment in traj.segments.items():
            assert tokenizer.decode(segment.tokens) == segment.text, seg_id
            if segment.kind != "output":
                assert tokenizer.encode(segment.text, add_special_tokens=False) == segment.tokens, seg_id


def test_validator_names_file_line_and_field(lora_trace, tmp_path):
    lines = lora_trace.read_text().splitlines()
    record = json.loads(lines[2])
    record["turns"][1]["agent"] = "critic"
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([lines[0], lines[1], json.dumps(record)]) + "\n")
    with pytest.raises(KvprofError, match=r"broken.jsonl line 3, field 'turns\[1\].agent': names agent 'critic'"):
        read_trace(broken)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["segments"]["question"].update(tokens=[1, "x"]), "segments.question.tokens"),
        (lambda r: r["segments"]["question"].update(tokens=[10**6]), "outside the tokenizer's vocabulary"),
        (lambda r: r["turns"][0]["input"].append("obs:99"), "does not define"),
        (lambda r: r["turns"][0].update(output="question"), "is not an output segment"),
        (lambda r: r["segments"]["question"].update(scope="public"), "not 'shared' or 'private'"),
    ],
)
def test_validator_rejects_bad_records(lora_trace, tmp_path, mutate, message):
    header, first = lora_trace.read_text().splitlines()[:2]
    record = json.loads(first)
    mutate(record)
    path = tmp_path / "bad.jsonl"
    path.write_text(header + "\n" + json.dumps(record) + "\n")
    with pytest.raises(KvprofError, match="bad.jsonl line 2") as err:
        read_trace(path)
    assert message in str(err.value)


def test_malformed_json_line(lora_trace, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(lora_trace.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(KvprofError, match="line 2.*not valid JSON"):
        read_trace(path)


def test_other_tokenizer_is_refused(lora_trace):
    header = read_header(lora_trace)
    other = tokenizer_identity(build_tokenizer(vocab_size=300))
    with pytest.raises(KvprofError, match="captured with tokenizer .* pass --model"):
        check_tokenizer(header, other, lora_trace, "other-model")


def test_segments_mark_shared_spans(lora_trace):
    for traj in read_trace(lora_trace).trajectories:
        shared = shared_segment_ids(traj)
        assert {"system", "question"} <= shared
        first_turn_outputs = traj.turns[0].output
        assert first_turn_outputs in shared  # the plan's output is read by act
        for seg_id in shared:
            assert traj.segments[seg_id].scope == "shared"


def test_react_shape_csv_import(tiny_world, tmp_path):
    csv_path = tmp_path / "react.csv"
    csv_path.write_text("agent,prefill_len,decode_len\n" + "".join(f"{a},{p},{d}\n" for a, p, d in REACT_SHAPE))
    tokenizer = load_tokenizer(str(tiny_world.model))
    trace = import_shape_csv(csv_path, tokenizer, tokenizer_identity(tokenizer), str(tiny_world.model), seed=3)
    out = write_trace(tmp_path / "react.jsonl", trace)
    written = read_trace(out)
    assert [len(t.turns) for t in written.trajectories] == [len(REACT_SHAPE)]
    traj = written.trajectories[0]
    assert traj.num_tokens == sum(p + d for _, p, d in REACT_SHAPE) == 17264
    previous = 0
    for turn, (agent, prefill, decode) in zip(traj.turns, REACT_SHAPE):
        assert turn.agent == agent
        assert len(traj.input_tokens(turn)) == previous + prefill
        assert len(traj.segments[turn.output]) == decode
        previous += prefill + decode
    again = import_shape_csv(csv_path, tokenizer, tokenizer_identity(tokenizer), str(tiny_world.model), seed=3)
    assert again.trajectories[0].segments == traj.segments
    assert set(written.header.agent_names) == {"plan", "action", "reflect"}


def test_shape_csv_bad_rows(tiny_world, tmp_path):
    tokenizer = load_tokenizer(str(tiny_world.model))
    bad = tmp_path / "bad.csv"
    bad.write_text("agent,prefill_len,decode_len\nplan,12,x\n")
    with pytest.raises(KvprofError, match="bad.csv line 2"):
        import_shape_csv(bad, tokenizer, tokenizer_identity(tokenizer), "m")
    bad.write_text("who,len\nplan,12\n")
    with pytest.raises(KvprofError, match="needs the header"):
        import_shape_csv(bad, tokenizer, tokenizer_identity(tokenizer), "m")
