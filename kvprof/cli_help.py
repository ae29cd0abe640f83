"""`--help` texts that come from torch-importing modules (the registered policies' options, tune-tau's τ grid), read
from `cli_help.json` so help and usage errors import no torch, transformers, peft, triton, ray or plotly.
Regenerate after changing a policy or option: `python -m kvprof.cli_help` (`tests/test_cli_import.py` checks it).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

HELP_FILE = Path(__file__).with_name("cli_help.json")


def generate() -> dict:
    """The help data from the live registry (imports torch): policy → option → `--help` text, and the default τ grid."""
    from kvprof.policies import REGISTRY
    from kvprof.tuning.tau import GRID

    return {
        "policies": {
            name: {key: option.describe() for key, option in cls.options.items()} for name, cls in REGISTRY.items()
        },
        "tune_grid": list(GRID),
    }


@cache
def help_data() -> dict:
    """The shipped help data (`cli_help.json`)."""
    return json.loads(HELP_FILE.read_text(encoding="utf-8"))


def policy_names() -> list[str]:
    """Every registered policy, in registry order."""
    return list(help_data()["policies"])


def policy_option_list() -> str:
    """Every registered policy option as POLICY.KEY=VALUES, for --help."""
    options = help_data()["policies"]
    return "; ".join(f"{name}.{key}={text}" for name, keys in options.items() for key, text in keys.items()) or "none"


def tune_grid() -> list[str]:
    """tune-tau's default threshold grid (`kvprof.tuning.tau.GRID`)."""
    return list(help_data()["tune_grid"])


if __name__ == "__main__":
    HELP_FILE.write_text(json.dumps(generate(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {HELP_FILE}")
