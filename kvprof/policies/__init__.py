"""Sharing policies: one module per method, one line per method in `REGISTRY`.

Adding a policy is a new module with a `SharingPolicy` subclass (see `kvprof.policies.base`) plus one line here; the
CLI's `--policy all`, the test matrix and the reports enumerate `REGISTRY` (`kvprof.policies.variants`).
"""

from __future__ import annotations

from kvprof.claims.types import Published
from kvprof.errors import KvprofError
from kvprof.policies.alorashared import ALoRAShared
from kvprof.policies.base import SharingPolicy
from kvprof.policies.baselrshared import BaseLRShared
from kvprof.policies.baseshared import BaseShared
from kvprof.policies.cacheblend import CacheBlend
from kvprof.policies.droidspeak import DroidSpeak
from kvprof.policies.fullshared import FullShared
from kvprof.policies.graphflow import GraphFlow
from kvprof.policies.hybrid import HybridALoRAShared, HybridFullShared
from kvprof.policies.kvcmas import KVCMAS
from kvprof.policies.kvcomm import KVComm
from kvprof.policies.nonshared import NonShared
from kvprof.policies.options import Option
from kvprof.policies.prelrshared import PreLRShared
from kvprof.policies.rebaseshared import ReBaseShared
from kvprof.policies.relaycaching import RelayCaching
from kvprof.policies.turns import TurnRequest, TurnResult
from kvprof.policies.variants import (
    PolicyVariant,
    command_selection,
    enumerate_variants,
    parse_policy_options,
    runnable_variants,
)

REGISTRY: dict[str, type[SharingPolicy]] = {
    "nonshared": NonShared,
    "fullshared": FullShared,
    "baseshared": BaseShared,
    "baselrshared": BaseLRShared,
    "prelrshared": PreLRShared,
    "rebaseshared": ReBaseShared,
    "alorashared": ALoRAShared,
    "droidspeak": DroidSpeak,
    "cacheblend": CacheBlend,
    "relaycaching": RelayCaching,
    "graphflow": GraphFlow,
    "kvcomm": KVComm,
    "kvcmas": KVCMAS,
}

# The policies that replay hybrid models with a class of their own (`kvprof.policies.hybrid`); NonShared runs as it is,
# the others are refused for them (`SharingPolicy.check_recurrent`).
ON_HYBRIDS: dict[str, type[SharingPolicy]] = {"fullshared": HybridFullShared, "alorashared": HybridALoRAShared}


def policy_class(name: str) -> type[SharingPolicy]:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in REGISTRY:
        raise KvprofError(f"unknown policy {name!r}; choose one of {', '.join(REGISTRY)} or all.")
    return REGISTRY[key]


__all__ = [
    "REGISTRY",
    "Option",
    "PolicyVariant",
    "Published",
    "SharingPolicy",
    "command_selection",
    "TurnRequest",
    "TurnResult",
    "enumerate_variants",
    "parse_policy_options",
    "policy_class",
    "runnable_variants",
]
