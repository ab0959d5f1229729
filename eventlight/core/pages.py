"""``PaginatedResult``: a page of query results that behaves like a sequence of its items
(Agent-lightning 0.3's type of the same name; re-exported by ``eventlight.core.types``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PaginatedResult(Sequence[T], Generic[T]):
    """A page of query results that behaves like a sequence of its items.

    Attributes:
        items: The page.
        limit: The requested limit (``-1`` = unlimited).
        offset: Items skipped before the page.
        total: Items that matched before paging.
    """

    __slots__ = ("items", "limit", "offset", "total")

    def __init__(self, items: Sequence[T], *, limit: int = -1, offset: int = 0, total: int | None = None):
        self.items = list(items)
        self.limit = limit
        self.offset = offset
        self.total = len(self.items) if total is None else total

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PaginatedResult):
            return (self.items, self.limit, self.offset, self.total) == (
                other.items,
                other.limit,
                other.offset,
                other.total,
            )
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self.items == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<PaginatedResult ({self.offset}:{self.offset + len(self.items)} of {self.total}) {self.items!r}>"
