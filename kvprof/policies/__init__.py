"""Sharing policies: one module per method, one line per method in `REGISTRY`.

`make_policy(name, runtime, **options)` builds one; the test matrix runs every registered policy.
"""

from __future__ import annotations

from kvprof.errors import KvprofError
from kvprof.policies.base import SharingPolicy, TurnRequest, TurnResult
from kvprof.policies.baselrshared import BaseLRShared
from kvprof.policies.baseshared import BaseShared
from kvprof.policies.fullshared import FullShared
from kvprof.policies.nonshared import NonShared
from kvprof.policies.prelrshared import PreLRShared
from kvprof.policies.rebaseshared import ReBaseShared

REGISTRY: dict[str, type[SharingPolicy]] = {
    "nonshared": NonShared,
    "fullshared": FullShared,
    "baseshared": BaseShared,
    "baselrshared": BaseLRShared,
    "prelrshared": PreLRShared,
    "rebaseshared": ReBaseShared,
}


def policy_class(name: str) -> type[SharingPolicy]:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in REGISTRY:
        raise KvprofError(f"unknown policy {name!r}; choose one of {', '.join(REGISTRY)} or all.")
    return REGISTRY[key]


def make_policy(name: str, runtime, **options: str) -> SharingPolicy:
    return policy_class(name)(runtime, **options)


__all__ = ["REGISTRY", "SharingPolicy", "TurnRequest", "TurnResult", "make_policy", "policy_class"]
