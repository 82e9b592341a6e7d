"""Token authentication for the Ray Jobs API (on by default in Ray 2.60 clusters).

Ray's client sends the cluster token only when RAY_AUTH_MODE=token, and reads that setting
when Ray is first imported; so the CLI decides before it imports Ray: when a token is at hand
(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token, which `ray start --head` writes
on the head machine) and the user set no mode, token mode is turned on.
"""

from __future__ import annotations

import os
from pathlib import Path


def enable_token_auth_if_available() -> bool:
    """Set RAY_AUTH_MODE=token for this process when a token exists; returns whether set."""
    if "RAY_AUTH_MODE" in os.environ or "ray" in __import__("sys").modules:
        return False
    has_token = (
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (Path.home() / ".ray" / "auth_token").is_file()
    )
    if has_token:
        os.environ["RAY_AUTH_MODE"] = "token"
    return bool(has_token)
