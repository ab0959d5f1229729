"""Credentials from the environment or from files, never from code.

``read_secret("EVENTLIGHT_X")`` is the value of ``EVENTLIGHT_X``, or the content of the file that
``EVENTLIGHT_X_FILE`` names (the ``_FILE`` convention of Docker and Kubernetes secrets; one trailing
newline stripped). ``NatsAuth`` is how eventlight authenticates to NATS (a token, a user and
password, or a ``.creds`` file), passed whole to ``connect_nats``. Neither ever shows a secret in
its ``repr`` or in an error message; ``eventlight.net.redact`` masks the ones inside URLs and DSNs.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError

__all__ = ["NatsAuth", "read_secret"]


def read_secret(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The secret held by environment variable ``name`` or by the file ``<name>_FILE`` names.

    Args:
        name: The variable, e.g. ``"EVENTLIGHT_PROXY_TOKEN"``.
        env: Where to look (default ``os.environ``).

    Returns:
        The value (a file's content without its trailing newline), ``None`` when neither is set
        (an empty value counts as unset).

    Raises:
        InvalidInputError: Both ``name`` and ``name_FILE`` are set, or the file is missing,
            unreadable, not UTF-8 or empty; the message names the variable and the file, never the
            secret.
    """
    env = os.environ if env is None else env
    value, path = env.get(name) or None, env.get(f"{name}_FILE") or None
    if value is not None and path is not None:
        raise InvalidInputError(f"set {name} or {name}_FILE, not both")
    if path is None:
        return value
    return _read_file(f"{name}_FILE", Path(path))


def check_bearer_token(token: str, what: str) -> str:
    """``token`` if an HTTP client can send it as ``Authorization: Bearer <token>``.

    Args:
        token: The token.
        what: Its name in the message (``"the server token"``, ``"EVENTLIGHT_PROXY_TOKEN"``).

    Raises:
        InvalidInputError: It is empty, or holds a space or a character outside visible ASCII (RFC
            6750's bearer token; a token file's stray space, a pasted non-breaking space); the
            message never shows the token.
    """
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise InvalidInputError(
            f"{what} must be visible ASCII characters without spaces: no client can send another in an"
            " Authorization header (RFC 6750's bearer token)"
        )
    return token


def _read_file(var: str, path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidInputError(f"{var}={path}: cannot read the file ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"{var}={path}: the file is not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        raise InvalidInputError(f"{var}={path}: the file is empty")
    return text


class NatsAuth(msgspec.Struct, frozen=True, kw_only=True):
    """How to authenticate to NATS (none, one of: a token, a user and password, a ``.creds`` file).

    Credentials in the URL (``nats://user:pass@host``, ``nats://token@host``) still work, as
    nats-py reads them; these are for keeping them out of the URL. ``repr`` masks the secrets.

    Attributes:
        token: ``EVENTLIGHT_NATS_TOKEN`` (or ``_FILE``): the server's ``authorization { token }``.
        user: ``EVENTLIGHT_NATS_USER``, with ``password``.
        password: ``EVENTLIGHT_NATS_PASSWORD`` (or ``_FILE``).
        creds_file: ``EVENTLIGHT_NATS_CREDS``: a decentralised-auth ``.creds`` file (JWT and nkey
            seed), given to nats-py as ``user_credentials``.

    Raises:
        InvalidInputError: Two methods at once, a user without a password or a password without a
            user, or a ``creds_file`` that cannot be read.
    """

    token: str | None = None
    user: str | None = None
    password: str | None = None
    creds_file: Path | None = None

    def __post_init__(self) -> None:
        methods = [m for m, on in (("token", self.token), ("user", self.user), ("creds", self.creds_file)) if on]
        if len(methods) > 1:
            raise InvalidInputError(
                f"NATS credentials: use one of EVENTLIGHT_NATS_TOKEN, EVENTLIGHT_NATS_USER/PASSWORD or "
                f"EVENTLIGHT_NATS_CREDS, not {' and '.join(methods)}"
            )
        if (self.user is None) != (self.password is None):
            raise InvalidInputError("EVENTLIGHT_NATS_USER and EVENTLIGHT_NATS_PASSWORD go together: set both")
        if self.creds_file is not None:
            _read_file("EVENTLIGHT_NATS_CREDS", self.creds_file)
            if importlib.util.find_spec("nkeys") is None:
                raise InvalidInputError("EVENTLIGHT_NATS_CREDS needs the nkeys package: pip install 'nats-py[nkeys]'")

    def __repr__(self) -> str:
        shown = {
            "token": self.token and "***",
            "user": self.user,
            "password": self.password and "***",
            "creds_file": self.creds_file,
        }
        return "NatsAuth(" + ", ".join(f"{k}={v!r}" for k, v in shown.items() if v is not None) + ")"

    def connect_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``nats.connect`` that carry these credentials (``{}`` for none)."""
        if self.token is not None:
            return {"token": self.token}
        if self.user is not None:
            return {"user": self.user, "password": self.password}
        if self.creds_file is not None:
            return {"user_credentials": str(self.creds_file)}
        return {}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NatsAuth:
        """Read ``EVENTLIGHT_NATS_TOKEN``/``_FILE``, ``EVENTLIGHT_NATS_USER``,
        ``EVENTLIGHT_NATS_PASSWORD``/``_FILE`` and ``EVENTLIGHT_NATS_CREDS``.

        Raises:
            InvalidInputError: As ``read_secret`` and the class say.
        """
        env = os.environ if env is None else env
        creds = env.get("EVENTLIGHT_NATS_CREDS") or None
        return cls(
            token=read_secret("EVENTLIGHT_NATS_TOKEN", env),
            user=env.get("EVENTLIGHT_NATS_USER") or None,
            password=read_secret("EVENTLIGHT_NATS_PASSWORD", env),
            creds_file=Path(creds) if creds else None,
        )
