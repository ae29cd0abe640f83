"""Broken models and adapters, as users have them (a half-downloaded safetensors, a config.json edited by hand, an
adapter trained for another base, NaN weights from a diverged run), are refused by every command that loads weights
in one sentence naming the file and the fix: exit 2, one `error:` line, no traceback, no output directory."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvprof.errors import KvprofError


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    record = json.loads(path.read_text(encoding="utf-8"))
    change(record)
    path.write_text(json.dumps(record), encoding="utf-8")


def edit_tensors(path: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def first_lora_a(tensors: dict[str, torch.Tensor]) -> str:
    return sorted(key for key in tensors if "lora_A" in key)[0]


def poison(tensors: dict[str, torch.Tensor], key: str, value: float) -> None:
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[3] = value


# Each broken model: (what breaks it, given the model directory's copy; what its refusal says).
MODEL_CASES: dict[str, tuple[Callable[[Path], object], str]] = {
    "no_weights": (lambda d: (d / "model.safetensors").unlink(), "check that it is a complete Hugging Face model"),
    "truncated_weights": (lambda d: cut_in_half(d / "model.safetensors"), "is not a complete safetensors file"),
    "no_config": (lambda d: (d / "config.json").unlink(), "config.json does not exist"),
    "config_not_json": (lambda d: (d / "config.json").write_text('{"hidden_size": 64,'), "is not valid JSON"),
    "config_not_object": (lambda d: (d / "config.json").write_text("[64]"), "is not a JSON object"),
    "config_sizes": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(intermediate_size=256)),
        "do not match its config.json: model.layers.0.mlp.down_proj.weight is [64, 128] in the weights",
    ),
    "config_more_layers": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(num_hidden_layers=3)),
        "asks for 3 layers but its weights hold 2",
    ),
    "config_missing_tensors": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(mlp_bias=True)),
        "they lack 6 tensors (model.layers.0.mlp.down_proj.bias",
    ),
    "config_fewer_layers": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(num_hidden_layers=1)),
        "which the config has no place for",
    ),
    "config_oversized": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(hidden_size=2**20)),
        "its sizes do not match the weights",
    ),
    "config_unbuildable": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(hidden_size=-64)),
        "describes no model transformers can build (RuntimeError",
    ),
    "config_wrong_type": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(hidden_size="64")),
        "is refused by transformers",
    ),
    "unknown_architecture": (
        lambda d: edit_json(d / "config.json", lambda c: c.update(model_type="foobar")),
        "upgrade transformers",
    ),
    "no_tokenizer": (
        lambda d: [path.unlink() for path in d.glob("tokenizer*")],
        "has no tokenizer",
    ),
    "nan_weights": (
        lambda d: edit_tensors(
            d / "model.safetensors", lambda t: poison(t, "model.layers.1.mlp.up_proj.weight", float("inf"))
        ),
        "non-finite weights (1 NaN or Inf values in model.layers.1.mlp.up_proj.weight)",
    ),
}
# Each broken adapter (of the agent `act`): (what breaks it, given the adapter directory's copy; its refusal).
ADAPTER_CASES: dict[str, tuple[Callable[[Path], object], str]] = {
    "no_weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "has no adapter_model.safetensors"),
    "truncated_weights": (
        lambda d: cut_in_half(d / "adapter_model.safetensors"),
        "adapter_model.safetensors is not a complete safetensors file",
    ),
    "config_not_json": (lambda d: (d / "adapter_config.json").write_text("r: 4"), "is not valid JSON"),
    "rank_zero": (lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(r=0)), "field r is 0"),
    "rank_above_weights": (
        lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(r=10**9)),
        "its weights have rank 4",
    ),
    "alpha_not_finite": (
        lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(lora_alpha=float("inf"))),
        "field lora_alpha holds Infinity, not a finite number",
    ),
    "targets_absent": (
        lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(target_modules=["attn_q", "attn_v"])),
        "names attn_q, attn_v, none of which is a module of this model",
    ),
    "peft_refuses": (
        lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(lora_dropout="high")),
        "is refused by peft",
    ),
    "other_base": (
        lambda d: edit_tensors(
            d / "adapter_model.safetensors", lambda t: t.update({first_lora_a(t): torch.ones(4, 32)})
        ),
        "was trained for another base model",
    ),
    "targets_fewer": (
        lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(target_modules=["q_proj"])),
        "holds weights for 6 modules its adapter_config.json does not adapt",
    ),
    "layers_edited": (
        lambda d: edit_json(d / "adapter_config.json", lambda c: c.update(layers_to_transform=[0])),
        "holds weights for 4 modules its adapter_config.json does not adapt (model.layers.1.",
    ),
    "nan_weights": (
        lambda d: edit_tensors(d / "adapter_model.safetensors", lambda t: poison(t, first_lora_a(t), float("nan"))),
        "non-finite weights (1 NaN or Inf values in base_model.model.model.layers.0.self_attn.k_proj.lora_A",
    ),
}


@pytest.fixture(scope="module")
def broken(tiny_world, tmp_path_factory) -> Path:
    """Each broken model under models/CASE and each broken adapter under adapters/CASE, built once."""
    root = tmp_path_factory.mktemp("broken")
    for cases, source, kind in (
        (MODEL_CASES, tiny_world.model, "models"),
        (ADAPTER_CASES, tiny_world.adapter("act"), "adapters"),
    ):
        for name, (breaks, _) in cases.items():
            shutil.copytree(source, root / kind / name)
            breaks(root / kind / name)
    return root


def refused(result: tuple[int, str, str], path: Path, message: str) -> None:
    """Exit 2 with one `error:` line naming `path` (a file in it or the directory) and saying `message`."""
    code, out, err = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0], err
    assert message in lines[0], lines[0]


def lora_agents(tiny_world, broken_adapter: Path) -> list[str]:
    """--agent flags of the tiny world's agents with `act` on `broken_adapter`."""
    flags = []
    for name in ("plan", "act", "reflect"):
        flags += ["--agent", f"{name}={broken_adapter if name == 'act' else tiny_world.adapter(name)}"]
    return flags


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_capture_refuses_a_broken_model(tiny_world, broken, tmp_path, run_cli, case):
    model = broken / "models" / case
    args = ["--model", model, "--workflow", tiny_world.prompt_workflow, "--tasks", tiny_world.tasks]
    refused(run_cli("capture", *args, "--device", "cpu", "--out", tmp_path / "out"), model, MODEL_CASES[case][1])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", sorted(ADAPTER_CASES))
def test_capture_refuses_a_broken_adapter(tiny_world, broken, tmp_path, run_cli, case):
    adapter = broken / "adapters" / case
    args = ["--model", tiny_world.model, *lora_agents(tiny_world, adapter), "--tasks", tiny_world.tasks]
    refused(run_cli("capture", *args, "--device", "cpu", "--out", tmp_path / "out"), adapter, ADAPTER_CASES[case][1])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["replay", "rank-analysis"])
def test_trace_commands_refuse_a_broken_model_or_adapter(tiny_world, broken, lora_trace, tmp_path, run_cli, command):
    """The commands that load a trace's model go through the same checks: a model and an adapter overridden."""
    model = broken / "models" / "nan_weights"
    flags = ["--device", "cpu", "--out", tmp_path / "out"]
    refused(run_cli(command, lora_trace, "--model", model, *flags), model, "non-finite weights")
    adapter = broken / "adapters" / "truncated_weights"
    refused(run_cli(command, lora_trace, "--agent", f"act={adapter}", *flags), adapter, "not a complete safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["fit-anchors", "tune-tau"])
def test_prompt_commands_refuse_a_broken_model(broken, prompt_trace, tmp_path, run_cli, command):
    model = broken / "models" / "config_sizes"
    flags = ["--device", "cpu", "--out", tmp_path / "out"]
    refused(run_cli(command, prompt_trace, "--model", model, *flags), model, "do not match its config.json")
    assert not (tmp_path / "out").exists()


# Values a hand edit leaves in a config field: wrong types, out of range, huge, not finite.
ODD_VALUES = st.sampled_from([None, True, -1, 0, 1, 3, 10**9, 0.5, float("nan"), "", "q_proj", [], ["x"], {}, {"a": 1}])


def mutations(fields: list[str]) -> st.SearchStrategy:
    """One to three edits of a JSON object: a field set to an odd value, or removed (`...`)."""
    edit = st.tuples(st.sampled_from(fields), st.one_of(ODD_VALUES, st.just(...)))
    return st.lists(edit, min_size=1, max_size=3)


def mutated(source: Path, folder: Path, file: str, edits: list[tuple[str, object]]) -> Path:
    """A copy of the directory `source` in `folder` with `edits` applied to its JSON `file`."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    record = json.loads((folder / file).read_text(encoding="utf-8"))
    for field, value in edits:
        if value is ...:
            record.pop(field, None)
        else:
            record[field] = value
    (folder / file).write_text(json.dumps(record), encoding="utf-8")
    return folder


ADAPTER_FIELDS = [
    "r", "lora_alpha", "target_modules", "lora_dropout", "bias", "fan_in_fan_out", "layers_to_transform",
    "layers_pattern", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "peft_type", "task_type",
    "modules_to_save", "init_lora_weights", "exclude_modules", "lora_bias",
]  # fmt: skip
MODEL_FIELDS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "model_type", "head_dim",
    "tie_word_embeddings", "hidden_act", "eos_token_id", "attention_bias", "mlp_bias", "architectures",
]  # fmt: skip


def loads_or_refuses(spec, model: Path) -> None:
    """Loading `spec`'s agents on `model` either works and runs every agent, or is a `KvprofError`."""
    from kvprof.model.agents import load_agents

    try:
        agents = load_agents(spec, str(model), device="cpu", dtype="float32")
    except KvprofError:
        return
    for name in spec.names:
        with agents.activate(name), torch.inference_mode():
            agents.model(input_ids=torch.tensor([[1, 2, 3]]))


# The same examples on every run; 300 of each found nothing when these tests were written.
FUZZ = settings(
    max_examples=15, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(edits=mutations(ADAPTER_FIELDS))
def test_no_adapter_config_edit_gives_a_traceback(tiny_world, tmp_path_factory, edits):
    from kvprof.traces.spec import build_spec

    folder = mutated(
        tiny_world.adapter("act"), tmp_path_factory.getbasetemp() / "fuzz_adapter", "adapter_config.json", edits
    )
    spec = build_spec(None, [f"plan={tiny_world.adapter('plan')}", f"act={folder}"])
    loads_or_refuses(spec, tiny_world.model)


@FUZZ
@given(edits=mutations(MODEL_FIELDS))
def test_no_model_config_edit_gives_a_traceback(tiny_world, tmp_path_factory, edits):
    from kvprof.traces.spec import build_spec

    folder = mutated(tiny_world.model, tmp_path_factory.getbasetemp() / "fuzz_model", "config.json", edits)
    spec = build_spec(None, [f"plan={tiny_world.adapter('plan')}"])
    loads_or_refuses(spec, folder)
