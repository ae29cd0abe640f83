"""The tuned-policy file (tuned.json): the threshold `kvprof tune-tau` recommends, as `kvprof replay --tuned` reads
it."""

from __future__ import annotations

from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.fileio import check_fields, read_json_file, write_json
from kvprof.results.tune_tau import TuneTauResult
from kvprof.tuning.tau import replay_flags

TUNED_KIND = "kvprof.tuned-policy"
TUNED_FILE = "tuned.json"


def write_tuned(out: Path, result: TuneTauResult) -> Path | None:
    """OUT/tuned.json of a tune-tau result, atomically; None when no threshold is recommended."""
    if result.recommended is None:
        return None
    return write_json(
        out / TUNED_FILE,
        {
            "kind": TUNED_KIND,
            "policy": result.policy,
            "policy_options": replay_flags(result),
            "target": result.target,
            "heldout_target_met": None if result.heldout is None else result.heldout.target_met,
        },
    )


def read_tuned(path: Path) -> tuple[str, list[str]]:
    """The policy and `--policy-option` values of a tuned.json, refused in one sentence naming the file if it is not
    one or names an unknown policy or option."""
    from kvprof.policies import enumerate_variants, parse_policy_options

    fix = "pass the tuned.json `kvprof tune-tau` wrote"
    saved = check_fields(
        read_json_file(path, "--tuned file", fix), {"kind": str, "policy": str, "policy_options": list}, str(path), fix
    )
    if saved["kind"] != TUNED_KIND or not all(isinstance(flag, str) for flag in saved["policy_options"]):
        raise KvprofError(f"--tuned {path} is not a tuned.json written by kvprof tune-tau; {fix}.")
    try:  # the policy and options it names, as the replay will read them
        enumerate_variants([saved["policy"]], parse_policy_options(saved["policy_options"]))
    except KvprofError as err:
        raise KvprofError(f"--tuned {path}: {err}") from None
    return saved["policy"], list(saved["policy_options"])


def with_tuned(policy: list[str], flags: list[str], tuned: Path | None) -> tuple[list[str], list[str]]:
    """--policy / --policy-option with the `tuned` file's added: its policy alone if --policy is `all`, else beside
    the named ones."""
    from kvprof.policies.variants import ALL

    if tuned is None:
        return policy, flags
    name, tuned_flags = read_tuned(tuned)
    return ([name] if policy == [ALL] else [*policy, name]), flags + tuned_flags
