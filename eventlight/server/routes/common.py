"""What every route module shares: the store of the app, and the paging checks of 0.3.0's server."""

from __future__ import annotations

from fastapi import Request

from eventlight.core.errors import InvalidInputError
from eventlight.store.base import LightningStore

__all__ = ["check_page", "store_of"]


def store_of(request: Request) -> LightningStore:
    """The store the app serves (``app.state.store``)."""
    store: LightningStore = request.app.state.store
    return store


INT64_MAX = 2**63 - 1


def check_page(limit: int, offset: int) -> None:
    """Agent-lightning 0.3.0's server checks: ``limit`` is ``-1`` or positive, ``offset`` not negative.

    Raises:
        InvalidInputError: Either is out of range, or above ``INT64_MAX`` (400).
    """
    if limit != -1 and limit <= 0:
        raise InvalidInputError(f"limit must be -1 (no limit) or positive, got {limit}")
    if offset < 0:
        raise InvalidInputError(f"offset must be >= 0, got {offset}")
    if max(limit, offset) > INT64_MAX:  # what Postgres' bigint holds
        raise InvalidInputError(f"limit and offset must be at most {INT64_MAX}, got {limit} and {offset}")
