"""Logging set-up for programs (Agent-lightning 0.3.0's ``agentlightning.logging``).

Library code never calls these; a program (or the CLI) does, once. They configure the
``eventlight`` logger hierarchy (and, for porting programs, ``agentlightning``'s name too).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["configure_logger", "log_level_from_env", "setup_logging", "setup_module_logging"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_level_from_env(default: str = "INFO", env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The level ``EVENTLIGHT_LOG_LEVEL`` names, in any case (``os.environ`` unless ``env``), and
    ``None``; ``default`` (a level name) when it is unset or empty; when it names no level,
    ``default`` and the warning to show, with the value as typed:
    ``EVENTLIGHT_LOG_LEVEL='bogus' is not a log level; using INFO``."""
    value = (os.environ if env is None else env).get("EVENTLIGHT_LOG_LEVEL") or default
    if value.upper() in logging.getLevelNamesMapping():
        return value.upper(), None
    return default, f"EVENTLIGHT_LOG_LEVEL={value!r} is not a log level; using {default}"


def configure_logger(level: int = logging.INFO, name: str = "eventlight") -> logging.Logger:
    """Reset logger ``name`` to one stdout handler at ``level``, not propagating to the root."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def setup_module_logging(
    level: int | str = "INFO", *, name: str = "eventlight", console: bool = True, propagate: bool = False, **_: Any
) -> logging.Logger:
    """Set up logger ``name``: ``level``, a console handler on stderr when ``console``."""
    logger = logging.getLogger(name)
    logger.setLevel(level)
    logger.propagate = propagate
    if console and not any(getattr(h, "_eventlight", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._eventlight = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return logger


def setup_logging(
    level: int | str = "INFO",
    *,
    console: bool = True,
    propagate: bool = False,
    capture_warnings: bool = False,
    submodule_levels: dict[str, int | str] | None = None,
    extra_handlers: list[logging.Handler] | None = None,
    formatter: logging.Formatter | None = None,
    apply_to: list[str] | None = None,
    files: str | dict[str, str] | None = None,
    **_: Any,
) -> None:
    """Configure the ``eventlight`` loggers (0.3.0's signature; ``color`` and the other rich-console
    options are accepted and ignored).

    Args:
        level: Level of ``eventlight`` (and of each logger in ``apply_to``).
        console: Log to stderr.
        propagate: Let records reach the root logger too.
        capture_warnings: Route ``warnings`` through logging.
        submodule_levels: Levels of sub-loggers, e.g. ``{"eventlight.store": "DEBUG"}``.
        extra_handlers: More handlers for ``eventlight``.
        formatter: The handlers' formatter.
        apply_to: Other logger names configured the same way.
        files: A log file for ``eventlight``, or logger name -> file.
    """
    names = ["eventlight", *(apply_to or [])]
    for name in names:
        logger = setup_module_logging(level, name=name, console=console, propagate=propagate)
        for handler in extra_handlers or []:
            logger.addHandler(handler)
    if isinstance(files, str):
        files = {"eventlight": files}
    for name, path in (files or {}).items():
        logging.getLogger(name).addHandler(logging.FileHandler(path))
    for name, sub_level in (submodule_levels or {}).items():
        logging.getLogger(name).setLevel(sub_level)
    if formatter is not None:
        for name in names:
            for handler in logging.getLogger(name).handlers:
                handler.setFormatter(formatter)
    logging.captureWarnings(capture_warnings)
