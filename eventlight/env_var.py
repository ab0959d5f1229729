"""Agent-lightning 0.3.0's environment variables (``agentlightning.env_var``) and their readers.

Every ``AGL_*`` variable eventlight reads is declared here; eventlight's own are in
``eventlight.settings``.
"""

from __future__ import annotations

import os
from enum import StrEnum

__all__ = ["LightningEnvVar", "resolve_bool_env_var", "resolve_int_env_var", "resolve_str_env_var"]


class LightningEnvVar(StrEnum):
    """Names of Agent-lightning's environment variables (same values as 0.3.0)."""

    AGL_EMITTER_DEBUG = "AGL_EMITTER_DEBUG"
    AGL_MANAGED_STORE = "AGL_MANAGED_STORE"
    AGL_CURRENT_ROLE = "AGL_CURRENT_ROLE"
    AGL_SERVER_HOST = "AGL_SERVER_HOST"
    AGL_SERVER_PORT = "AGL_SERVER_PORT"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def resolve_str_env_var(
    env_var: LightningEnvVar, override: str | None = None, fallback: str | None = None
) -> str | None:
    """``override`` if given, else the variable's value if set, else ``fallback``."""
    if override is not None:
        return override
    value = os.environ.get(env_var.value)
    return fallback if value is None else value


def resolve_bool_env_var(
    env_var: LightningEnvVar, override: bool | None = None, fallback: bool | None = None
) -> bool | None:
    """As ``resolve_str_env_var``, reading ``1/true/yes/on`` and ``0/false/no/off`` (any case).

    Raises:
        ValueError: The variable holds something else.
    """
    if override is not None:
        return override
    value = os.environ.get(env_var.value)
    if value is None:
        return fallback
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{env_var.value}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def resolve_int_env_var(
    env_var: LightningEnvVar, override: int | None = None, fallback: int | None = None
) -> int | None:
    """As ``resolve_str_env_var``, as an integer.

    Raises:
        ValueError: The variable is not an integer.
    """
    if override is not None:
        return override
    value = os.environ.get(env_var.value)
    if value is None:
        return fallback
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{env_var.value}={value!r} is not an integer") from None
