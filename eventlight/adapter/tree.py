"""``TraceTree``: a span tree built from a flat span list, and its repair and LLM-call search."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from eventlight.adapter.attrs import (
    OPERATION_NAME,
    OPERATION_SPAN,
    REWARD_OPERATION,
    VIRTUAL_ROOT_ID,
    _agent_name,
    _time,
)
from eventlight.adapter.base import RewardMatchPolicy
from eventlight.adapter.dedup import copy_of, response_id
from eventlight.adapter.stats import AdapterStats
from eventlight.core.types import Span
from eventlight.rewards import get_reward_value

log = logging.getLogger(__name__)


class _Unset:
    """The type of ``_UNSET``: a node's reward not read yet."""


_UNSET = _Unset()


class TraceTree:
    """A span and its children, built from a flat span list (Agent-lightning ``TraceTree``).

    Attributes:
        id: The span id (``"virtual-root"`` for the synthetic root over several roots).
        span: The span; synthetic nodes get an ``agentlightning.virtual`` span with no attributes.
        children: Child nodes in input order.
    """

    def __init__(self, id: str, span: Span, children: list[TraceTree] | None = None):
        self.id = id
        self.span = span
        self.children = children or []
        self._reward: float | None | _Unset = _UNSET
        self.cycles_cut = 0  # on a root from ``from_spans``: parent cycles it had to cut

    @property
    def start_time(self) -> float | None:
        return self.span.start_time

    @property
    def end_time(self) -> float | None:
        return self.span.end_time

    def traverse(self) -> list[TraceTree]:
        """All nodes, depth first, pre-order, children in input order."""
        out: list[TraceTree] = []
        stack = [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def agent_name(self) -> str | None:
        return _agent_name(self.span)

    def reward(self) -> float | None:
        """The span's reward (``get_reward_value``), read once per node."""
        if isinstance(self._reward, _Unset):
            self._reward = get_reward_value(self.span)
        return self._reward

    def is_reward_span(self) -> bool:
        """A reward-carrying span, or an ``agentlightning.operation`` named ``agentlightning.reward``."""
        if self.reward() is not None:
            return True
        attrs = self.span.attributes or {}
        return self.span.name == OPERATION_SPAN and attrs.get(OPERATION_NAME) == REWARD_OPERATION

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_spans(cls, spans: Sequence[Span]) -> TraceTree:
        """Link spans by ``parent_id``; missing parents and several roots get synthetic nodes.

        Parent links that form a cycle (bad input: ``a -> b -> a``) would leave the spans on it out
        of the tree; instead the first span of each cycle (in input order) is taken as a root, its
        link cut, with a warning naming it.

        Raises:
            ValueError: ``spans`` is empty.
        """
        if not spans:
            raise ValueError("no spans to build a trace tree from")
        by_id = {s.span_id: s for s in spans}
        children: dict[str, list[str]] = {}
        roots = [s.span_id for s in spans if s.parent_id is None]
        for s in spans:
            if s.parent_id is not None and s.parent_id != s.span_id:
                children.setdefault(s.parent_id, []).append(s.span_id)
        roots += [pid for pid in children if pid not in by_id]  # lost parents (e.g. a session span)
        cut = _cycle_roots(spans, roots, children)
        nodes = [cls._build(rid, by_id, children) for rid in roots + cut]
        tree = (
            nodes[0]
            if len(nodes) == 1
            else cls(VIRTUAL_ROOT_ID, _synthetic_span(VIRTUAL_ROOT_ID, nodes, name="virtual-root"), nodes)
        )
        tree.cycles_cut = len(cut)
        return tree

    @classmethod
    def _build(cls, node_id: str, by_id: dict[str, Span], children: dict[str, list[str]]) -> TraceTree:
        kids = [cls._build(cid, by_id, children) for cid in children.get(node_id, [])]
        span = by_id.get(node_id) or _synthetic_span(node_id, kids)
        return cls(node_id, span, kids)

    # -- repair ----------------------------------------------------------------------------

    def repair_hierarchy(self) -> None:
        """Move top-level children under the span that encloses them most tightly in time.

        Mixed instrumentation can leave LLM spans floating directly under the root instead of
        under their agent. Like Agent-lightning: if this node has one child, repair that child
        instead; otherwise each original child (until one remains) is moved under the node of the
        tree (not itself, not this root) whose ``[start, end]`` contains it with the smallest
        strictly positive slack (the first in pre-order among equal ones). Simplified: only this
        top level is repaired, and nodes with a missing start or end time are neither moved nor
        chosen as parents. The same moves as Agent-lightning's loop in O(n log n) instead of
        O(children x nodes) (``eventlight.adapter.repair``).
        """
        from eventlight.adapter.repair import repair_hierarchy

        repair_hierarchy(self)

    # -- LLM calls and rewards ---------------------------------------------------------------

    def find_llm_calls(
        self,
        *,
        llm_call_match: str,
        agent_match: str | None,
        exclude_llm_call_in_reward: bool = True,
        dedup_llm_call: bool = True,
        stats: AdapterStats | None = None,
    ) -> list[tuple[TraceTree, str]]:
        """LLM call nodes (DFS pre-order) with the name of their enclosing matching agent.

        Rules (Agent-lightning 0.3): the span name must ``re.search``-match ``llm_call_match``;
        with ``agent_match=None`` the whole tree counts (agent ``"*"``), otherwise only nodes below
        an agent whose name matches (a non-matching agent resets it); with
        ``exclude_llm_call_in_reward`` nothing below a reward span counts; with ``dedup_llm_call``
        a nested match without response id below a matched call is skipped, and of the copies of
        one call (the same response id, or the same output: ``eventlight.adapter.dedup``) only one
        is kept: the one with token ids (Agent-lightning keeps the first seen); both are counted in
        ``stats.duplicates`` when given. A node's own agent/reward status applies to its
        descendants only.
        """
        calls, dropped = self.find_llm_calls_counted(
            llm_call_match=llm_call_match,
            agent_match=agent_match,
            exclude_llm_call_in_reward=exclude_llm_call_in_reward,
            dedup_llm_call=dedup_llm_call,
        )
        if stats is not None:
            stats.duplicates += sum(dropped.values())
        return calls

    def find_llm_calls_counted(
        self,
        *,
        llm_call_match: str,
        agent_match: str | None,
        exclude_llm_call_in_reward: bool = True,
        dedup_llm_call: bool = True,
    ) -> tuple[list[tuple[TraceTree, str]], dict[str, int]]:
        """``find_llm_calls`` and, per kept call's node id, how many duplicate copies were dropped."""
        walker = _LlmCallWalker(llm_call_match, agent_match, exclude_llm_call_in_reward, dedup_llm_call)
        walker.visit(self, "*" if agent_match is None else None, False, None)
        if not dedup_llm_call:
            return walker.found, {}
        found = walker.found
        kept = copy_of([node.span for node, _ in found])
        index = {node.id: i for i, (node, _) in enumerate(found)}
        counts: dict[str, int] = {}
        for i, k in enumerate(kept):
            if i != k:
                counts[found[k][0].id] = counts.get(found[k][0].id, 0) + 1
        for node_id, n in walker.nested.items():  # nested copies without response id, skipped above
            keeper = found[kept[index[node_id]]][0].id
            counts[keeper] = counts.get(keeper, 0) + n
        return [found[i] for i in sorted(set(kept))], counts

    def match_rewards(self, policy: RewardMatchPolicy | str, llm_calls: Sequence[TraceTree]) -> dict[str, float]:
        """Map LLM call ids to the rewards credited to them (see ``RewardMatchPolicy``).

        Spans without a start time sort last; a call without an end time is never credited.
        """
        ids = {c.id for c in llm_calls}
        rewards: dict[str, float] = {}
        if RewardMatchPolicy(policy) is RewardMatchPolicy.FIRST_OCCURRENCE:
            ordered = sorted(self.traverse(), key=lambda n: _time(n.start_time, float("inf")))
            _credit_in_order(ordered, ids, rewards)
        else:
            for node in self.traverse():
                _credit_in_order(node.children, ids, rewards)
        return rewards


class _LlmCallWalker:
    """Depth-first search state of ``TraceTree.find_llm_calls``."""

    def __init__(self, llm_call_match: str, agent_match: str | None, exclude_in_reward: bool, dedup: bool):
        self.llm_call_match = re.compile(llm_call_match)
        self.agent_match = None if agent_match is None else re.compile(agent_match)
        self.exclude_in_reward = exclude_in_reward
        self.dedup = dedup
        self.found: list[tuple[TraceTree, str]] = []
        self.nested: dict[str, int] = {}  # enclosing call's node id -> nested copies skipped

    def visit(self, node: TraceTree, agent: str | None, in_reward: bool, in_llm_call: str | None) -> None:
        """``in_llm_call``: the node id of the matched call this node is below, if any."""
        if self._is_call(node, agent, in_reward, in_llm_call):
            self.found.append((node, agent))  # type: ignore[arg-type]  # _is_call checks agent
            in_llm_call = in_llm_call or node.id
        name = node.agent_name()
        if name is not None:
            agent = name if self.agent_match is None or self.agent_match.search(name) else None
        in_reward = in_reward or (self.exclude_in_reward and node.is_reward_span())
        for child in node.children:
            self.visit(child, agent, in_reward, in_llm_call)

    def _is_call(self, node: TraceTree, agent: str | None, in_reward: bool, in_llm_call: str | None) -> bool:
        if agent is None or in_reward or self.llm_call_match.search(node.span.name) is None:
            return False
        if not self.dedup or in_llm_call is None or response_id(node.span.attributes or {}) is not None:
            return True
        self.nested[in_llm_call] = self.nested.get(in_llm_call, 0) + 1
        return False


def _reach(start: str, children: dict[str, list[str]], seen: set[str]) -> None:
    stack = [start]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(children.get(node, ()))


def _cycle_roots(spans: Sequence[Span], roots: list[str], children: dict[str, list[str]]) -> list[str]:
    """Spans no root reaches (they hang on a parent cycle), one per cycle, their parent link cut."""
    seen: set[str] = set()
    for root in roots:
        _reach(root, children, seen)
    extra: list[str] = []
    for span in spans:
        if span.span_id in seen:
            continue
        siblings = children.get(span.parent_id or "", [])
        if span.span_id in siblings:
            siblings.remove(span.span_id)
        log.warning(
            "span %s (%r) of rollout %s: its parent links form a cycle; taken as a root",
            span.span_id,
            span.name,
            span.rollout_id,
        )
        extra.append(span.span_id)
        _reach(span.span_id, children, seen)
    return extra


def _credit_in_order(nodes: Sequence[TraceTree], llm_ids: set[str], rewards: dict[str, float]) -> None:
    """Walk ``nodes`` in order; each reward goes to the latest unrewarded call that ended before it."""
    calls: list[tuple[str, float]] = []
    for node in nodes:
        if node.id in llm_ids:
            calls.append((node.id, _time(node.end_time, float("inf"))))
        value = node.reward()
        if value is None:
            continue
        start = _time(node.start_time, float("inf"))
        for call_id, end in reversed(calls):
            if end <= start and call_id not in rewards:
                rewards[call_id] = value
                break


def _synthetic_span(span_id: str, children: Sequence[TraceTree], name: str | None = None) -> Span:
    """A placeholder span covering ``children`` in time, with ids copied from the first child."""
    first = children[0].span
    starts = [c.start_time for c in children if c.start_time is not None]
    ends = [c.end_time for c in children if c.end_time is not None]
    return Span.from_attributes(
        attributes={},
        rollout_id=first.rollout_id,
        attempt_id=first.attempt_id,
        sequence_id=first.sequence_id,
        trace_id=first.trace_id,
        span_id=span_id,
        name=name,
        start_time=min(starts) if starts else None,
        end_time=max(ends) if ends else None,
    )
