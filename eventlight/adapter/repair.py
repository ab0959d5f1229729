"""``TraceTree.repair_hierarchy`` in O(n log n): the same moves as Agent-lightning's quadratic loop.

The rule (Agent-lightning 0.3's, unchanged): each original top-level child of the node repaired,
until one remains, moves under the node of the tree -- not the repaired node, not a node with the
child's id, not one lacking a finite start or end -- whose ``[start, end]`` contains the child's
with the smallest strictly positive slack ``(end - child.end) + (child.start - start)``; among
equal slacks the first in depth-first pre-order of the tree as it is at that moment.

How, without scanning the whole tree per child:

* The slack is the candidate's duration minus the child's, so the tightest encloser is the
  shortest interval that contains the child's and is not identical to it. Two sweeps over the
  intervals by start, with a Fenwick tree of minimum durations keyed by end, give every child the
  shortest such duration once (``shortest_enclosing``).
* A child then looks only at candidates whose duration lies between that and a few ulps above the
  first valid one (durations sorted once); each slack is computed with the original formula, so
  float rounding picks the same node, and a tie goes to the earlier node in pre-order, found from
  parent links. Moves keep the set of nodes except when a child is moved under its own
  descendant (a malformed trace: that subtree leaves the tree, as in the original); its nodes
  stop being candidates.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eventlight.adapter.tree import TraceTree

INF = float("inf")
ULPS = 64
"""Window above the shortest valid duration, in ulps of the largest time (rounding is a few)."""


class _MinFenwick:
    """Prefix minima over positions ``0..n-1`` that only ever decrease."""

    def __init__(self, n: int):
        self.tree = [INF] * (n + 1)

    def lower(self, pos: int, value: float) -> None:
        tree, i = self.tree, pos + 1
        while i < len(tree):
            if value < tree[i]:
                tree[i] = value
            i += i & -i

    def prefix_min(self, count: int) -> float:
        tree, best = self.tree, INF
        while count > 0:
            best = min(best, tree[count])
            count -= count & -count
        return best


def shortest_enclosing(points: list[tuple[float, float]], queries: list[tuple[float, float]]) -> list[float]:
    """For each query ``(start, end)``, the least ``end - start`` of a point interval containing it
    and not identical to it (``inf``: none). O((points + queries) log points).

    Containing and not identical is the union of (start strictly before, end at or after) and
    (start at or before, end strictly after): one sweep each, by start.
    """
    ends = sorted({e for _, e in points})  # Fenwick position 0 is the largest end
    by_start = sorted(points)
    order = sorted(range(len(queries)), key=lambda q: queries[q][0])
    best = [INF] * len(queries)
    for strict_start in (True, False):
        fenwick, i = _MinFenwick(len(ends)), 0
        for q in order:
            cs, ce = queries[q]
            while i < len(by_start) and (by_start[i][0] < cs or (not strict_start and by_start[i][0] == cs)):
                ns, ne = by_start[i]
                fenwick.lower(len(ends) - 1 - bisect_left(ends, ne), ne - ns)
                i += 1
            cut = bisect_left(ends, ce) if strict_start else bisect_right(ends, ce)
            best[q] = min(best[q], fenwick.prefix_min(len(ends) - cut))
    return best


def _times(node: TraceTree) -> tuple[float, float] | None:
    s, e = node.start_time, node.end_time
    if s is None or e is None or not (math.isfinite(s) and math.isfinite(e)):
        return None  # never contains nor is contained in the original (comparisons fail or slack is inf/nan)
    return s, e


class _Repair:
    """One ``repair_hierarchy`` of ``root``'s top level (see the module docstring)."""

    def __init__(self, root: TraceTree):
        self.root = root
        nodes = root.traverse()
        self.parent: dict[int, TraceTree] = {id(c): n for n in nodes for c in n.children}
        self.detached: set[int] = set()
        timed = [(t, n) for n in nodes[1:] if (t := _times(n)) is not None]
        timed.sort(key=lambda tn: tn[0][1] - tn[0][0])
        self.cands = timed
        self.durations = [e - s for (s, e), _ in timed]
        largest = max((max(abs(s), abs(e)) for (s, e), _ in timed), default=0.0)
        self.tol = ULPS * math.ulp(largest)

    def run(self) -> None:
        root = self.root
        children = list(root.children)
        queried = [(c, t) for c in children if (t := _times(c)) is not None]
        shortest = shortest_enclosing([t for t, _ in self.cands], [t for _, t in queried])
        todo = {id(c): (t, d) for (c, t), d in zip(queried, shortest, strict=True)}
        for child in children:
            if len(root.children) == 1:
                break
            if id(child) not in todo:
                continue
            times, least = todo[id(child)]
            target = self._tightest(child, times, least)
            if target is None:
                continue
            if self._is_below(target, child):  # moving it under its own descendant cuts it off
                self.detached.update(id(n) for n in child.traverse())
            root.children.remove(child)
            target.children.append(child)
            self.parent[id(child)] = target

    def _tightest(self, child: TraceTree, times: tuple[float, float], least: float) -> TraceTree | None:
        cs, ce = times
        best: TraceTree | None = None
        best_slack = INF
        limit = INF
        for i in range(bisect_left(self.durations, least), len(self.cands)):
            if self.durations[i] > limit:
                break
            (ns, ne), node = self.cands[i]
            if not (ns <= cs and ne >= ce) or node.id == child.id or id(node) in self.detached:
                continue
            slack = (ne - ce) + (cs - ns)
            if not 0 < slack < INF:
                continue
            if best is None:
                limit = self.durations[i] + self.tol
            if slack < best_slack or (slack == best_slack and best is not None and self._before(node, best)):
                best, best_slack = node, slack
        return best

    def _path(self, node: TraceTree) -> list[TraceTree]:
        """``node`` and its ancestors below the root, top first."""
        out = []
        while node is not self.root:
            out.append(node)
            node = self.parent[id(node)]
        out.reverse()
        return out

    def _before(self, a: TraceTree, b: TraceTree) -> bool:
        """Whether ``a`` comes before ``b`` in depth-first pre-order of the tree now."""
        pa, pb = self._path(a), self._path(b)
        k = 0
        while k < len(pa) and k < len(pb) and pa[k] is pb[k]:
            k += 1
        if k == len(pa) or k == len(pb):
            return k == len(pa)  # an ancestor comes first
        siblings = (pa[k - 1] if k else self.root).children
        return siblings.index(pa[k]) < siblings.index(pb[k])

    def _is_below(self, node: TraceTree, ancestor: TraceTree) -> bool:
        while node is not self.root:
            if node is ancestor:
                return True
            node = self.parent[id(node)]
        return False


def nests(intervals: list[tuple[float, float]]) -> bool:
    """Whether one interval contains another it is not identical to: when none does, no child has
    a node to move under (a flat trace, such as the LLM proxy's spans alone). O(n log n)."""
    ordered = sorted(intervals, key=lambda t: (t[0], -t[1]))
    reach = reach_before = -INF  # the largest end so far; and of those that started strictly earlier
    start_here = None
    for s, e in ordered:
        if s != start_here:
            reach_before, start_here = reach, s
        if reach > e or reach_before >= e:  # same start and a later end, or an earlier start and not an earlier end
            return True
        reach = max(reach, e)
    return False


def repair_hierarchy(tree: TraceTree) -> None:
    """Repair ``tree`` in place (``TraceTree.repair_hierarchy``): descend through single children,
    then re-parent that node's top-level children."""
    while len(tree.children) == 1:
        tree = tree.children[0]
    if len(tree.children) > 1:
        repair = _Repair(tree)
        if nests([t for t, _ in repair.cands]):
            repair.run()
