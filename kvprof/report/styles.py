"""One look per policy label (colour, marker, dash), the same in every figure (docs/commands/report.md).

Colour and marker from the policy name, shade, dash and fill from the variant suffix (`variant_label`). Colours:
Okabe & Ito ("Color Universal Design", 2008), then Paul Tol's muted scheme, in a fixed table; unknown names hash
(CRC-32) to a style.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

DENSE = "nonshared"  # the dense run: every report's reference

# name → (colour, plotly marker symbol, index of its dash in DASHES); black for the dense reference, vermillion for
# the naive baseline. Policies that can compute the same cache (baselrshared and prelrshared with shared A) differ in
# dash as well as colour.
KNOWN: dict[str, tuple[str, str, int]] = {
    DENSE: ("#000000", "circle", 0),
    "fullshared": ("#D55E00", "x", 0),
    "baseshared": ("#0072B2", "square", 0),
    "baselrshared": ("#56B4E9", "diamond", 0),
    "prelrshared": ("#009E73", "triangle-up", 1),
    "rebaseshared": ("#CC79A7", "triangle-down", 2),
    "droidspeak": ("#E69F00", "pentagon", 0),
    "cacheblend": ("#882255", "star", 1),
    "relaycaching": ("#999933", "hexagon", 2),
    "graphflow": ("#44AA99", "cross", 3),
    "kvcomm": ("#332288", "star-triangle-up", 4),
    "kvcmas": ("#AA4499", "diamond-wide", 5),
}
FALLBACK_COLOURS = ("#117733", "#DDCC77", "#88CCEE", "#CC6677", "#661100", "#6699CC", "#888888")
FALLBACK_SYMBOLS = ("circle", "square", "diamond", "triangle-left", "triangle-right", "octagon", "bowtie")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
# The variants the registry sweeps today, pinned so that no two variants of one policy share a dash; other variant
# suffixes get an offset from a hash.
KNOWN_VARIANTS: dict[str, int] = {"code": 1, "full": 0, "incremental": 2, "lp": 0, "db": 4, "chain": 0, "star": 1}
FILLS = ("", "-open", "-dot")  # plotly marker symbol suffixes: filled, open, dotted
# Per variant offset: how far the family colour is mixed towards white (> 0) or black (< 0), so that variants of one
# policy differ in shade where a figure has no dash (bars, boxes).
TINTS = (0.0, 0.45, -0.35, 0.25, -0.2, 0.6)
UNFILLABLE = ("x", "cross")  # symbols drawn as strokes only


@dataclass(frozen=True)
class PolicyStyle:
    """How one label is drawn: line and marker colour, marker symbol, line dash."""

    color: str
    symbol: str
    dash: str

    def line(self, width: float = 2.0) -> dict:
        return {"color": self.color, "dash": self.dash, "width": width}

    def marker(self, size: float = 8.0) -> dict:
        return {"color": self.color, "symbol": self.symbol, "size": size, "line": {"color": self.color, "width": 1}}


def _hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def policy_name(label: str) -> str:
    """The policy a label belongs to: `rebaseshared-db` → `rebaseshared`."""
    return label.split("-", 1)[0].lower()


def policy_style(label: str) -> PolicyStyle:
    """The style of a policy label (deterministic: the same label gets the same style in every report)."""
    name = policy_name(label)
    variant = label[len(name) + 1 :]
    if name in KNOWN:
        color, symbol, dash = KNOWN[name]
    else:
        color = FALLBACK_COLOURS[_hash(name) % len(FALLBACK_COLOURS)]
        symbol = FALLBACK_SYMBOLS[_hash(name) // 7 % len(FALLBACK_SYMBOLS)]
        dash = _hash(name) // 49 % len(DASHES)
    offset = KNOWN_VARIANTS.get(variant, _hash(variant) % len(DASHES)) if variant else 0
    fill = "" if symbol in UNFILLABLE else FILLS[offset % len(FILLS)]
    return PolicyStyle(tint(color, TINTS[offset]), symbol + fill, DASHES[(dash + offset) % len(DASHES)])


def tint(color: str, amount: float) -> str:
    """`color` (#rrggbb) mixed with white (amount > 0) or black (amount < 0) by |amount|."""
    target = 255 if amount > 0 else 0
    channels = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (target - c) * abs(amount)):02X}" for c in channels)
