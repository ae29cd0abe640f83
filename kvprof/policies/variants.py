"""Policy variants as data: which (policy, options) pairs a replay runs, with their labels (`enumerate_variants`,
used by the CLI, the test matrix and the reports).

`--policy all`: every policy with the product of its options' `sweep` values; a named policy: its published defaults;
`--policy-option POLICY.KEY=VALUE` values replace the sweep (each value replayed).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvprof.errors import KvprofError
from kvprof.model.runtime import Runtime
from kvprof.policies.base import SharingPolicy
from kvprof.policies.options import variant_label

ALL = "all"
OptionValues = dict[str, dict[str, list[str]]]  # policy name → option key → values to replay


@dataclass(frozen=True)
class PolicyVariant:
    """One policy with one value per option, e.g. PolicyVariant("rebaseshared", {"schedule": "db"})."""

    name: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def policy(self) -> type[SharingPolicy]:
        from kvprof.policies import policy_class

        return policy_class(self.name)

    @property
    def label(self) -> str:
        """The name results are keyed by (`variant_label`), e.g. rebaseshared-db."""
        cls = self.policy
        return variant_label(cls.name, cls.options, self.options)

    @property
    def trajectory_independent(self) -> bool:
        """Whether this variant replays each trajectory alone (`SharingPolicy.independent_of_trajectories`)."""
        return self.policy.independent_of_trajectories(self.options)

    def build(self, runtime: Runtime) -> SharingPolicy:
        """The policy on `runtime`'s model (a hybrid's own class where it has one, `ON_HYBRIDS`)."""
        from kvprof.policies import ON_HYBRIDS

        cls = ON_HYBRIDS.get(self.policy.name, self.policy) if runtime.recurrent else self.policy
        return cls(runtime, **self.options)


def parse_policy_options(flags: Iterable[str]) -> OptionValues:
    """`POLICY.KEY=VALUE` flags → {policy: {key: [values]}}, checked against the policies' declared options."""
    from kvprof.policies import policy_class

    values: OptionValues = {}
    for flag in flags:
        target, sep, value = flag.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or not name or not key or not value:
            raise KvprofError(
                f"--policy-option {flag!r} is not POLICY.KEY=VALUE; write e.g. "
                "--policy-option rebaseshared.schedule=db."
            )
        cls = policy_class(name)
        option = cls.options.get(key)
        if option is None:
            raise KvprofError(
                f"--policy-option {flag!r}: policy {cls.name} has no option {key!r}; its options are "
                f"{', '.join(cls.options) or 'none'}."
            )
        option.check(cls.name, key, value)
        chosen = values.setdefault(cls.name, {}).setdefault(key, [])
        if value not in chosen:
            chosen.append(value)
    return values


def enumerate_variants(
    selection: Sequence[str] = (ALL,), option_values: OptionValues | None = None
) -> list[PolicyVariant]:
    """The variants a selection replays (registry order; nonshared last when others run, as a same-run check of
    the dense baseline). `selection`: policy names or `all`; `option_values`: from `parse_policy_options`."""
    from kvprof.policies import REGISTRY, policy_class

    sweep = any(name.lower() == ALL for name in selection)
    classes = list(REGISTRY.values()) if sweep else [policy_class(name) for name in selection]
    classes = list(dict.fromkeys(classes))
    option_values = option_values or {}
    unselected = sorted(set(option_values) - {cls.name for cls in classes})
    if unselected:
        raise KvprofError(
            f"options are given for policy {', '.join(unselected)}, which is not selected; add "
            f"--policy {unselected[0]} (or --policy all) or drop its options."
        )
    variants = []
    for cls in classes:
        given = option_values.get(cls.name, {})
        axes = [
            given.get(key) or (list(option.sweep or (option.default,)) if sweep else [option.default])
            for key, option in cls.options.items()
        ]
        for values in itertools.product(*axes):
            variants.append(PolicyVariant(cls.name, dict(zip(cls.options, values))))
    labels = [variant.label for variant in variants]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise KvprofError(
            f"two variants would both be labelled {twice[0]}: an option that does not show in labels (a file) "
            "takes one value per replay; run one replay per value."
        )
    if len(variants) > 1:
        variants = [v for v in variants if v.name != "nonshared"] + [v for v in variants if v.name == "nonshared"]
    return variants


def command_selection(variants: Sequence[PolicyVariant]) -> tuple[list[str], list[str]]:
    """The `--policy` / `--policy-option` flags that replay `variants` (labels, in order); `KvprofError` when none
    can (a selection replays the product of each policy's values)."""
    from kvprof.policies import policy_class

    names = list(dict.fromkeys(variant.name for variant in variants))
    # an option every variant of its policy leaves at its default needs no flag (an empty default could not take one)
    at_default = {
        (name, key)
        for name in names
        for key, option in policy_class(name).options.items()
        if all(v.options.get(key, option.default) == option.default for v in variants if v.name == name)
    }
    flags = list(
        dict.fromkeys(
            f"{v.name}.{key}={value}"
            for v in variants
            for key, value in v.options.items()
            if (v.name, key) not in at_default
        )
    )
    replayed = [variant.label for variant in enumerate_variants(names, parse_policy_options(flags))]
    if sorted(replayed) != sorted(variant.label for variant in variants):
        raise KvprofError(
            f"no --policy/--policy-option selection replays exactly {', '.join(v.label for v in variants)}; "
            "replay them in separate runs."
        )
    return names, flags


def runnable_variants(
    variants: Sequence[PolicyVariant], runtime: Runtime, skip: bool
) -> tuple[list[PolicyVariant], dict[str, str]]:
    """The variants this runtime can replay, and {label: reason} for the others (`skip=False`: raise the first)."""
    runnable, skipped = [], {}
    for variant in variants:
        try:
            variant.build(runtime)
        except KvprofError as err:
            if not skip:
                raise
            skipped[variant.label] = str(err)
            continue
        runnable.append(variant)
    return runnable, skipped


SHORTHANDS = {"schedule": ("rebaseshared", "schedule"), "lr_prefill": ("baseshared", "lr_prefill")}
Runnable = Callable[[list[PolicyVariant], bool], tuple[list[PolicyVariant], dict[str, str]]]


def choose_variants(
    policy: list[str], policy_options: list[str], schedule: str | None, lr_prefill: str | None, runnable: Runnable
) -> tuple[list[PolicyVariant], dict[str, str]]:
    """--policy / --policy-option / the documented shorthands → the variants to replay; with `all`, those this
    setup cannot run are skipped (label → reason). `runnable(variants, skip)`: `runnable_variants` on the loaded
    agents (here, or on a Ray worker)."""
    flags = list(policy_options)
    for value, (name, key) in zip((schedule, lr_prefill), SHORTHANDS.values()):
        if value:
            flags.append(f"{name}.{key}={value}")
    variants = enumerate_variants(policy, parse_policy_options(flags))
    return runnable(variants, any(name.lower() == ALL for name in policy))
