"""Spans (or runs) as the tree their parent ids draw: checked (no missing parent, no cycle) and walked in order.

The order is depth first, each node's children by start time, the roots by start time: calls made one after the
other come in the order they were made, and a sub-agent's calls stay inside the call tree that started them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprof.traces.stores.common import fail


@dataclass
class Node:
    """One span or run: its key, its parent's key (None for a root), a sortable start, how messages name it (`where`)
    and what the reader keeps of it (`record`)."""

    key: str
    parent: str | None
    start: object
    where: str
    record: Any


def ordered(path: Path, nodes: list[Node], kind: str) -> list[Node]:
    """`nodes` depth first (children by start), refusing a duplicate key, a missing parent or a cycle; `kind` names
    what the nodes are ("span", "run") in the refusals."""
    by_key: dict[str, Node] = {}
    for node in nodes:
        if node.key in by_key:
            raise fail(path, node.where, "appears twice", f"export each {kind} once")
        by_key[node.key] = node
    children: dict[str | None, list[Node]] = {}
    for node in nodes:
        if node.parent is not None and node.parent not in by_key:
            raise fail(
                path,
                node.where,
                f"names a parent {kind} the export does not hold",
                f"export the whole trace (every {kind} of it), not some {kind}s",
            )
        children.setdefault(node.parent, []).append(node)
    for node in nodes:
        _check_no_cycle(path, node, by_key, kind)
    order: list[Node] = []
    stack = sorted(children.get(None, []), key=_start, reverse=True)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(sorted(children.get(node.key, []), key=_start, reverse=True))
    return order


def _start(node: Node):
    return (node.start, node.key)


def _check_no_cycle(path: Path, node: Node, by_key: dict[str, Node], kind: str) -> None:
    seen = {node.key}
    parent = node.parent
    while parent is not None:
        if parent in seen:
            raise fail(
                path,
                node.where,
                f"is its own ancestor (its parent ids form a cycle through {by_key[parent].where})",
                f"export the {kind}s with the parent ids the tracer gave them",
            )
        seen.add(parent)
        parent = by_key[parent].parent


def ancestors(node: Node, by_key: dict[str, Node]) -> list[Node]:
    """The node, its parent, and so on up to its root (the tree checked by `ordered`)."""
    chain = [node]
    while chain[-1].parent is not None:
        chain.append(by_key[chain[-1].parent])
    return chain
