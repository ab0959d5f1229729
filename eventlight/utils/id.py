"""Ids (``agentlightning.utils.id``): eventlight's id generator."""

from eventlight.core.types import generate_id

__all__ = ["generate_id"]
