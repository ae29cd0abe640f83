"""The policy contract: one module plus one registry line is all a policy needs to be enumerated by `--policy all`,
replayed, checked against the dense run and reported; options reach any policy through `--policy-option`."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from test_policies import check_variant

from kvprof.errors import KvprofError
from kvprof.model.agents import load_agents_for_trace
from kvprof.model.runtime import Runtime
from kvprof.policies import (
    REGISTRY,
    PolicyVariant,
    command_selection,
    enumerate_variants,
    parse_policy_options,
    runnable_variants,
)
from kvprof.policies.options import ORIGINS
from kvprof.replay.lockstep import replay_trace
from kvprof.traces.trace import read_trace

THROWAWAY = '''"""Throwaway: a test policy that keeps each agent's own cache (exact), with one swept option."""

from kvprof.claims.types import Published
from kvprof.policies.options import Option
from kvprof.policies.nonshared import NonShared


class Throwaway(NonShared):
    name = "throwaway"
    family = "test"
    paper = "The Throwaway Paper (2026)"
    approximate = False
    options = {"flavour": Option("plain", ("plain", "salted"), sweep=("plain", "salted"))}
    published = (Published("The Throwaway Paper (2026)", "Table 9", "a tiny world", "nothing is lost"),)
'''


def _replayed(run_cli, trace, out, *args) -> list[str]:
    """`kvprof replay TRACE ARGS` on one trajectory, one repeat; the labels of the policies it replayed."""
    code, _, err = run_cli("replay", trace, *args, "--limit", "1", "--repeats", "1", "--out", out)
    assert code == 0, err
    return list(json.loads((out / "replay.json").read_text())["policies"])


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """Write the policy module to disk, import it, and add its one registry line."""
    path = tmp_path / "throwaway_policy.py"
    path.write_text(THROWAWAY)
    spec = importlib.util.spec_from_file_location("throwaway_policy", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "throwaway_policy", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(REGISTRY, "throwaway", module.Throwaway)
    return module.Throwaway


def test_a_new_policy_module_is_enumerated_replayed_checked_and_reported(throwaway, run_cli, lora_trace, tmp_path):
    labels = [variant.label for variant in enumerate_variants()]
    assert {"throwaway-plain", "throwaway-salted"} <= set(labels)
    code, out, err = run_cli(
        "replay", lora_trace, "--policy", "all", "--limit", "1", "--repeats", "1", "--out", tmp_path, "--device", "cpu"
    )
    assert code == 0, err
    assert "throwaway-plain" in out and "throwaway-salted" in out
    result = json.loads((tmp_path / "replay.json").read_text())
    for label in ("throwaway-plain", "throwaway-salted"):
        entry = result["policies"][label]
        assert entry["options"] == {"flavour": label.split("-")[1]}
        check_variant(entry, result["dense"], memory_checked=False)
    agents = load_agents_for_trace(lora_trace, device="cpu", dtype="float32")
    checked = replay_trace(
        agents,
        read_trace(lora_trace).trajectories,
        [v for v in enumerate_variants() if v.name == "throwaway"],
        check_memory=True,
    )
    for entry in checked["policies"].values():
        check_variant(entry, checked["dense"])
    assert result["policies"]["throwaway-salted"]["published"][0]["claim"] == "nothing is lost"
    html = (tmp_path / "replay.html").read_text()
    assert "The Throwaway Paper (2026)" in html and "nothing is lost" in html
    code, out, err = run_cli("report", tmp_path / "replay.json", "--out", tmp_path / "dash.html")
    assert code == 0, err
    assert "throwaway-salted" in out and "nothing is lost" in (tmp_path / "dash.html").read_text()


def test_policy_option_selects_values_of_any_policy(throwaway, run_cli, lora_trace, tmp_path):
    assert _replayed(
        run_cli, lora_trace, tmp_path, "--policy", "throwaway", "--policy-option", "throwaway.flavour=salted"
    ) == ["throwaway-salted"]


def test_policy_all_sweeps_every_declared_option_value():
    labels = [variant.label for variant in enumerate_variants()]
    for cls in REGISTRY.values():
        for key, option in cls.options.items():
            for value in option.sweep or (option.default,):
                assert any(label.startswith(cls.name) and option.label(key, value) in label for label in labels), (
                    cls.name,
                    key,
                    value,
                )
    assert "baseshared-incremental" in labels and "rebaseshared-db" in labels
    assert labels[-1] == "nonshared"


def test_option_origins_name_choices_and_show_in_help():
    """Where an option's choices come from (the authors' code, the paper's text, kvprof) is one of `ORIGINS`, given
    for choices the option has, and `--help` shows it."""
    for cls in REGISTRY.values():
        for key, option in cls.options.items():
            assert set(option.origins) <= set(option.choices or ()), (cls.name, key)
            assert set(option.origins.values()) <= set(ORIGINS), (cls.name, key)
            for choice, origin in option.origins.items():
                assert f"{choice} ({origin})" in option.describe()
    assert REGISTRY["baseshared"].options["lr_prefill"].origins["code"] == "code"


def test_named_policy_runs_its_published_defaults_and_shorthands_still_work(run_cli, lora_trace, tmp_path):
    assert [v.label for v in enumerate_variants(["rebaseshared"])] == ["rebaseshared-lp"]
    assert [v.label for v in enumerate_variants(["baseshared"])] == ["baseshared-code"]
    both = parse_policy_options(["rebaseshared.schedule=lp", "rebaseshared.schedule=db"])
    assert [v.label for v in enumerate_variants(["rebaseshared"], both)] == ["rebaseshared-lp", "rebaseshared-db"]
    assert _replayed(run_cli, lora_trace, tmp_path, "--policy", "rebaseshared", "--schedule", "db") == [
        "rebaseshared-db"
    ]


def test_command_selection_replays_exactly_the_variants():
    """The `--policy` / `--policy-option` a result records for a list of variants (as `kvprof demo` writes them)
    replay exactly those variants; a list no selection gives is refused."""
    variants = [
        PolicyVariant("fullshared"),
        PolicyVariant("kvcmas", {"chain": "chain", "anchors": "pool.safetensors"}),
        PolicyVariant("kvcmas", {"chain": "star", "anchors": "pool.safetensors"}),
    ]
    names, flags = command_selection(variants)
    assert names == ["fullshared", "kvcmas"]
    assert flags == ["kvcmas.chain=chain", "kvcmas.anchors=pool.safetensors", "kvcmas.chain=star"]
    replayed = enumerate_variants(names, parse_policy_options(flags))
    assert [v.label for v in replayed] == [v.label for v in variants]
    assert all(v.options["anchors"] == "pool.safetensors" for v in replayed if v.name == "kvcmas")
    defaults = enumerate_variants(["droidspeak", "prelrshared"])  # every option given, at its default ('' too)
    assert any(value == "" for v in defaults for value in v.options.values())
    assert command_selection(defaults) == (["droidspeak", "prelrshared"], [])
    not_a_product = [
        PolicyVariant("cacheblend", {"ratio": "0.1", "deviation": "key"}),
        PolicyVariant("cacheblend", {"ratio": "0.2", "deviation": "value"}),
    ]
    with pytest.raises(KvprofError, match="no --policy/--policy-option selection replays exactly"):
        command_selection(not_a_product)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--policy-option", "rebaseshared.schedule"), "is not POLICY.KEY=VALUE"),
        (("--policy-option", "rebaseshared.speed=fast"), "policy rebaseshared has no option 'speed'"),
        (("--policy-option", "rebaseshared.schedule=xx"), "option schedule='xx' is not allowed; use one of lp, db"),
        (("--policy-option", "magic.schedule=lp"), "unknown policy 'magic'"),
        (
            ("--policy", "fullshared", "--schedule", "db"),
            "options are given for policy rebaseshared, which is not selected",
        ),
    ],
)
def test_bad_policy_options_are_one_sentence(run_cli, lora_trace, tmp_path, args, message):
    code, _, err = run_cli("replay", lora_trace, *args, "--out", tmp_path)
    assert code == 2 and message in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "replay.json").exists()


def test_variant_labels_match_built_policies(lora_trace, prompt_trace):
    runtimes = {
        mode: Runtime(load_agents_for_trace(trace, device="cpu", dtype="float32"))
        for mode, trace in (("lora", lora_trace), ("prompt", prompt_trace))
    }
    for variant in enumerate_variants():
        runtime = runtimes["lora" if "lora" in variant.policy.modes else "prompt"]
        if variant.name == "baselrshared":
            with pytest.raises(KvprofError, match="share their down-projection A"):
                variant.build(runtime)
            continue
        assert variant.build(runtime).label == variant.label
    assert PolicyVariant("rebaseshared", {"schedule": "db"}).label == "rebaseshared-db"
    assert PolicyVariant("rebaseshared", {"own_lr": "neutral"}).label == "rebaseshared-lp-neutral"


@pytest.mark.parametrize("mode", ["lora", "prompt"])
def test_trajectory_independent_variants_replay_a_trajectory_alone_as_in_sequence(mode, request, tmp_path):
    """What sharded replay rests on: a variant that says it keeps no state across trajectories
    (`PolicyVariant.trajectory_independent`) records the same for a trajectory replayed alone as after others
    (timings apart); every runnable variant of `--policy all`, plus in prompt mode a frozen fitted anchor pool."""
    from kvprof.policies.delta import pool_identity
    from kvprof.tuning.anchor_fit import fit_anchors

    agents = load_agents_for_trace(request.getfixturevalue(f"{mode}_trace"), device="cpu", dtype="float32")
    runtime = Runtime(agents)
    trajectories = read_trace(request.getfixturevalue(f"{mode}_trace")).trajectories[:2]
    variants = [v for v in runnable_variants(enumerate_variants(), runtime, skip=True)[0] if v.trajectory_independent]
    if mode == "prompt":
        pool, _ = fit_anchors(agents, trajectories[:1], 4, 10)
        anchors = str(pool.save(tmp_path / "pool.safetensors", pool_identity(runtime)))
        variants.append(PolicyVariant("kvcmas", {"pool": "frozen", "rank": "4", "anchors": anchors}))
    assert variants and all(v.trajectory_independent for v in variants)
    in_sequence = replay_trace(agents, trajectories, variants)
    alone = replay_trace(agents, trajectories[1:], variants)
    timings = {"ttft_s", "decode_s", "latency_s"}
    for label in [v.label for v in variants]:
        after = [r for r in in_sequence["policies"][label]["turns"] if r["trajectory"] == trajectories[1].id]
        assert [{k: v for k, v in r.items() if k not in timings} for r in after] == [
            {k: v for k, v in r.items() if k not in timings} for r in alone["policies"][label]["turns"]
        ], label
