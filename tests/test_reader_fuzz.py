"""Property: a reader of a user's file, given a valid file with a random mutation (cut, flipped or inserted bytes,
bytes that are not UTF-8, an empty file, a directory, a JSON key deleted, added or given another type, a record or
line dropped or repeated, a TOML value or CSV cell replaced, a pool's metadata or tensor changed), either reads it (a
mutation can leave it valid) or raises a `KvprofError` whose message is one line naming the file; never anything else.

Each reader is called as its command calls it, without a model: `inspect` on traces, `import_log` on chat logs (the
imported trace then read back), `capture_spec` on workflow TOML, `load_tasks`, `import_shape_csv`,
`AnchorPool.load` and `pool_digest`, `read_tuned`, `LayerProfile.read`, the `simulate` command on replay and
serve-bench results, the `report` command on simulate, tune-tau, inspect and replay results.
tests/data/results/replay.json is the result of `kvprof replay kvprof/demo/assets/sample_traces/lora_short.jsonl
--policy nonshared --policy fullshared --limit 1 --repeats 1 --device cpu`.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprof.demo.assets import demo_world
from kvprof.errors import KvprofError
from kvprof.policies.anchors import AnchorPool, pool_digest

DATA = Path(__file__).parent / "data"
OTHER_VALUES = (None, True, 0, -1, 2.5, 10**12, "", "x\ny", [], [1, "a"], {}, {"x": 1})
TOML_VALUES = ('"text"', "7", "-1", "true", "[1, 2]", '["a"]', "{ a = 1 }", "1979-05-27", "3.5")
POOL_IDENTITY = {"model": "m", "shape": "2x2x4", "tokenizer": "sha256:t", "dtype": "float32"}


# ------------------------------------------------------------------------------------------------------ mutations


def fuzz(examples: int):
    """Hypothesis settings of these tests: `examples` examples, the same ones on every run."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def json_paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside a JSON value, the root's () included."""
    paths = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += json_paths(item, (*prefix, index))
    return paths


def mutate_json(data: st.DataObject, value: object) -> object:
    """`value` with one value inside it deleted, given another type, repeated (in a list) or joined by an extra key
    (in an object); the depth of the value is drawn first, so shallow and deep fields alike are hit."""
    value = copy.deepcopy(value)
    paths = [path for path in json_paths(value) if path]
    if not paths:
        return data.draw(st.sampled_from(OTHER_VALUES))
    depth = data.draw(st.integers(1, max(len(path) for path in paths)), label="depth")
    path = data.draw(st.sampled_from([p for p in paths if len(p) == depth] or paths), label="path")
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = data.draw(st.sampled_from(["delete", "retype", "repeat"]), label="action")
    if action == "delete":
        del parent[key]
    elif action == "retype":
        parent[key] = data.draw(st.sampled_from(OTHER_VALUES), label="value")
    elif isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    else:
        parent[f"{key}_extra"] = copy.deepcopy(parent[key])
    return value


def mutate_lines(data: st.DataObject, lines: list[str], replace: Callable[[str], str]) -> list[str]:
    """`lines` with one dropped, repeated, swapped with the next or changed by `replace`."""
    lines = list(lines)
    index = data.draw(st.integers(0, len(lines) - 1), label="line")
    action = data.draw(st.sampled_from(["drop", "repeat", "swap", "replace"]), label="line action")
    if action == "drop":
        del lines[index]
    elif action == "repeat":
        lines.insert(index, lines[index])
    elif action == "swap" and index + 1 < len(lines):
        lines[index], lines[index + 1] = lines[index + 1], lines[index]
    elif action == "replace":
        lines[index] = replace(lines[index])
    return lines


def structural(data: st.DataObject, content: bytes, form: str) -> bytes:
    """A mutation that keeps the file's syntax: JSON values, JSONL records, TOML values, CSV cells."""
    text = content.decode("utf-8")
    if form == "json":
        value = json.loads(text)
        for _ in range(data.draw(st.integers(1, 3), label="changes")):
            value = mutate_json(data, value)
        return json.dumps(value).encode()
    lines = text.splitlines()
    if form == "jsonl":

        def replace(line: str) -> str:
            return json.dumps(mutate_json(data, json.loads(line)))

    elif form == "toml":

        def replace(line: str) -> str:
            name, sep, _ = line.partition(" = ")
            return f"{name} = {data.draw(st.sampled_from(TOML_VALUES), label='toml value')}" if sep else line

    else:

        def replace(line: str) -> str:
            cells = line.split(",")
            cells[data.draw(st.integers(0, len(cells) - 1))] = data.draw(st.sampled_from(["", "x", "-3", "1.5", "9"]))
            return ",".join(cells)

    return ("\n".join(mutate_lines(data, lines, replace)) + "\n").encode()


def mutated(data: st.DataObject, content: bytes, form: str) -> bytes | None:
    """`content` mutated (see module docstring); None stands for a directory in the file's place."""
    kinds = ["cut", "flip", "insert", "not utf-8", "empty", "directory"] + (["structure"] * 4 if form else [])
    kind = data.draw(st.sampled_from(kinds), label="mutation")
    if kind == "cut":
        return content[: data.draw(st.integers(0, len(content) - 1), label="cut at")]
    if kind in ("flip", "insert"):
        changed = bytearray(content)
        for _ in range(data.draw(st.integers(1, 4), label="bytes")):
            at = data.draw(st.integers(0, len(changed) - 1), label="at")
            byte = data.draw(st.integers(1, 255), label="byte")
            if kind == "flip":
                changed[at] ^= byte
            else:
                changed.insert(at, byte)
        return bytes(changed)
    if kind == "not utf-8":
        return b"\xff\xfe" + data.draw(st.binary(max_size=64), label="bytes")
    if kind == "empty":
        return b""
    if kind == "directory":
        return None
    return structural(data, content, form)


def holds_to_the_rule(read: Callable[[Path], object], content: bytes | None, name: str) -> None:
    """Write `content` (None: a directory) as `name` in a fresh folder and read it: it is read, or refused with a
    one-line `KvprofError` naming it."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        try:
            read(path)
        except KvprofError as err:
            message = str(err)
            assert len(message.splitlines()) == 1, message
            assert str(path) in message, message


# ------------------------------------------------------------------------------------------------------ readers


@pytest.fixture(scope="module")
def world():
    return demo_world()


@pytest.fixture(scope="module")
def tokenizer(world):
    from kvprof.model.agents import load_tokenizer

    return load_tokenizer(str(world.model))


def first_lines(path: Path, count: int) -> bytes:
    return ("\n".join(path.read_text(encoding="utf-8").splitlines()[:count]) + "\n").encode()


@given(data=st.data())
@fuzz(60)
def test_trace_inspect(world, data):
    from kvprof.commands.inspect import command as inspect

    content = first_lines(world.sample_traces["lora_short"], 3)
    holds_to_the_rule(inspect, mutated(data, content, "jsonl"), "trace.jsonl")


@given(data=st.data())
@fuzz(40)
def test_chat_log_import(world, tokenizer, data):
    from kvprof.model.agents import tokenizer_identity
    from kvprof.traces.chat import PLAIN_TEMPLATE, resolve_chat_template
    from kvprof.traces.chat_log import import_log
    from kvprof.traces.trace import read_trace, write_trace

    def read(path: Path) -> None:
        template = resolve_chat_template(str(world.chat_template), tokenizer) or PLAIN_TEMPLATE
        imported = import_log(path, tokenizer, template, tokenizer_identity(tokenizer), str(world.model))
        read_trace(write_trace(path.parent / "imported.jsonl", imported.trace))

    content = first_lines(world.sample_chat_log, 7)
    holds_to_the_rule(read, mutated(data, content, "jsonl"), "log.jsonl")


@given(data=st.data())
@fuzz(60)
def test_workflow_toml(world, data):
    from kvprof.capture.runner import capture_spec

    mode = data.draw(st.sampled_from(["lora", "prompt"]), label="mode")
    content = world.workflow(mode).read_bytes()
    holds_to_the_rule(capture_spec, mutated(data, content, "toml"), "workflow.toml")


@given(data=st.data())
@fuzz(60)
def test_tasks(world, data):
    from kvprof.traces.tasks import load_tasks

    holds_to_the_rule(load_tasks, mutated(data, first_lines(world.heldout_tasks, 3), "jsonl"), "tasks.jsonl")


@given(data=st.data())
@fuzz(60)
def test_shape_csv(world, tokenizer, data):
    from kvprof.model.agents import tokenizer_identity
    from kvprof.traces.shapes import import_shape_csv

    def read(path: Path) -> None:
        import_shape_csv(path, tokenizer, tokenizer_identity(tokenizer), str(world.model))

    content = b"agent,prefill_len,decode_len,trajectory\nplan,8,4,t0\nact,6,3,t0\nplan,5,2,t1\n"
    holds_to_the_rule(read, mutated(data, content, "csv"), "shapes.csv")


@pytest.fixture(scope="module")
def pools() -> dict[str, bytes]:
    """A full-dimensional and a rank-2 pool of one slot: an anchor owned by `plan` with `act`'s delta, and a
    context-free one, for a model of shape 2 layers x 2 heads x 4 dims."""
    generator = torch.Generator().manual_seed(0)
    files = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, rank in (("full", None), ("rank2", 2)):
            pool = AnchorPool(4, 2, rank)
            for anchor_name, owner in (("t0/out:plan:0", "plan"), ("t1/out:plan:0", None)):
                keys, values = (torch.randn(2, 2, 5, 4, generator=generator) for _ in range(2))
                anchor = pool.insert("out:plan:0", anchor_name, owner, keys, values)
                pool.add_delta(anchor, "act", keys + 0.1, values - 0.1)
            files[name] = pool.save(Path(folder) / f"{name}.safetensors", POOL_IDENTITY).read_bytes()
    return files


def mutate_pool(data: st.DataObject, content: bytes) -> bytes:
    """A pool file rewritten with its metadata or one tensor changed: a key dropped or given other text, a value
    inside its identity or layout JSON mutated, a tensor dropped or replaced by one of another shape or dtype."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    tensors = load(content)
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as handle:
        handle.write(content)
        handle.flush()
        with safe_open(handle.name, framework="pt") as opened:
            metadata = dict(opened.metadata())
    action = data.draw(st.sampled_from(["drop key", "other text", "json", "drop tensor", "tensor"]), label="pool")
    key = data.draw(st.sampled_from(sorted(metadata)), label="key")
    name = data.draw(st.sampled_from(sorted(tensors)), label="tensor")
    if action == "drop key":
        del metadata[key]
    elif action == "other text":
        metadata[key] = data.draw(st.sampled_from(["", "x", "-1", "2", "{}", "[]", "null"]), label="text")
    elif action == "json":
        key = data.draw(st.sampled_from(["identity", "layout"]), label="json key")
        metadata[key] = json.dumps(mutate_json(data, json.loads(metadata[key])))
    elif action == "drop tensor":
        del tensors[name]
    else:
        shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4), label="shape")
        dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.int64]), label="dtype")
        tensors[name] = torch.zeros(shape, dtype=dtype)
    return save(tensors, metadata=metadata)


@given(data=st.data())
@fuzz(60)
def test_anchor_pool(pools, data):
    def read(path: Path) -> None:
        AnchorPool.load(path, POOL_IDENTITY, torch.device("cpu"))
        pool_digest(path)

    content = pools[data.draw(st.sampled_from(sorted(pools)), label="pool")]
    rewrite = data.draw(st.booleans(), label="rewrite")
    holds_to_the_rule(read, mutate_pool(data, content) if rewrite else mutated(data, content, ""), "pool.safetensors")


@given(data=st.data())
@fuzz(60)
def test_tuned_file(data):
    from kvprof.tuning.tuned import TUNED_KIND, read_tuned

    tuned = {
        "kind": TUNED_KIND,
        "policy": "kvcmas",
        "policy_options": ["kvcmas.rank=4", "kvcmas.tau=0.3"],
        "target": "KL(dense ‖ policy) at most 0.05 nats per output token",
        "heldout_target_met": True,
    }
    holds_to_the_rule(read_tuned, mutated(data, json.dumps(tuned).encode(), "json"), "tuned.json")


@given(data=st.data())
@fuzz(40)
def test_droidspeak_profile(data):
    from kvprof.policies.droidspeak import LayerProfile

    profile = LayerProfile([0.1, 0.4, 0.2, 0.05], [1.0, 2.0, 2.0, 1.0], 3).to_json("m")

    def read(path: Path) -> None:
        LayerProfile.read(str(path), 4)

    holds_to_the_rule(read, mutated(data, json.dumps(profile).encode(), "json"), "profile.json")


def simulate(replay: Path, out: Path, calibration: Path | None = None) -> None:
    """`kvprof simulate` at one load for two simulated seconds, its result in `out`."""
    from kvprof.commands.simulate import command

    command(replay=replay, calibration=calibration, qps=[1.0], duration=2.0, out=out)


@given(data=st.data())
@fuzz(40)
def test_replay_result_simulated(data):
    def read(path: Path) -> None:
        simulate(path, path.parent / "simulated")

    content = (DATA / "simulate" / "replay.json").read_bytes()
    holds_to_the_rule(read, mutated(data, content, "json"), "replay.json")


@given(data=st.data())
@fuzz(25)
def test_serve_bench_result_simulated(data):
    def read(path: Path) -> None:
        simulate(DATA / "simulate" / "replay.json", path.parent / "simulated", path)

    content = (DATA / "simulate" / "serve_bench.json").read_bytes()
    holds_to_the_rule(read, mutated(data, content, "json"), "serve_bench.json")


def report(path: Path) -> None:
    from kvprof.commands.report import command

    command([path], out=path.parent / "report.html")


@pytest.fixture(scope="module")
def results(world, tmp_path_factory) -> dict[str, bytes]:
    """A simulate result (of the simulate fixtures), a tune-tau result (of a sweep whose replays are made up), an
    inspect result (of the demo world's short lora trace) and a replay result (tests/data/results)."""
    from kvprof.commands.common import result_envelope
    from kvprof.commands.inspect import command as inspect
    from kvprof.fileio import write_json
    from kvprof.traces.trace import read_trace
    from kvprof.tuning.tau import GRID, Target, tune

    folder = tmp_path_factory.mktemp("results")
    simulate(DATA / "simulate" / "replay.json", folder)

    real = json.loads((DATA / "results" / "replay.json").read_bytes())

    def made_up(trajectories, variants, sweep) -> dict:
        """A replay's payload: tests/data/results/replay.json's dense run (12 tokens prefilled) and one of its
        policies per variant, their summaries' numbers made up."""
        policy = real["policies"]["fullshared"]
        summaries = {
            variant.label: policy
            | {
                "summary": policy["summary"]
                | {
                    "delta_reuse": k / len(variants),
                    "kl": 0.1 * (1 - k / len(variants)) ** 2,
                    "top1": 0.9,
                    "k_error": 0.1,
                    "v_error": 0.2,
                    "layers": [],
                    "prefilled": 10 - k,
                    "ttft_speedup": 1 + k / 10,
                    "latency_speedup": 1 + k / 20,
                    "memory_ratio": 1.2,
                    "peak_memory_bytes": 4096,
                }
            }
            for k, variant in enumerate(variants)
        }
        dense = real["dense"] | {"summary": real["dense"]["summary"] | {"prefilled": 12}}
        return {"dense": dense, "policies": summaries}

    trajectories = read_trace(world.sample_traces["prompt_short"]).trajectories
    swept = tune(made_up, trajectories[:2], trajectories[2:], "kvcmas", {"rank": "4"}, GRID, Target(max_kl=0.05), False)
    swept.trace, swept.model, swept.pool = "trace.jsonl", "model", "pool.safetensors"
    write_json(folder / "tune_tau.json", result_envelope("tune_tau", swept.to_json(), {}))
    inspect(world.sample_traces["lora_short"], out=folder)
    return {
        "simulate": (folder / "simulate.json").read_bytes(),
        "tune_tau": (folder / "tune_tau.json").read_bytes(),
        "inspect": (folder / "inspect.json").read_bytes(),
        "replay": (DATA / "results" / "replay.json").read_bytes(),
    }


@pytest.mark.parametrize("kind", ["simulate", "tune_tau", "inspect", "replay"])
def test_result_files_are_reported(results, kind):
    holds_to_the_rule(report, results[kind], f"{kind}.json")


@given(data=st.data())
@fuzz(100)
def test_result_reported(results, data):
    kind = data.draw(st.sampled_from(sorted(results)), label="kind")
    holds_to_the_rule(report, mutated(data, results[kind], "json"), f"{kind}.json")
