"""Which Ray cluster `rlsys submit` and `rlsys jobs` talk to, decided as Ray's own CLI does.

The address is `--address`, else `RAY_API_SERVER_ADDRESS`, else `RAY_ADDRESS`: the Jobs API
URL of the head (`http://HEAD:8265`), or a cluster address (`HEAD:6379`) from which Ray
finds that URL. Standard library only (the CLI decides before it imports Ray).
"""

from __future__ import annotations

import os

from rlsys.cli.errors import UserError

ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
ADDRESS_HELP = (
    "Ray Jobs API address, e.g. http://HEAD:8265 (else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS)."
)


def cluster_address(explicit: str | None) -> str | None:
    """The cluster to talk to, or None when neither the flag nor the environment names one."""
    if explicit:
        return explicit
    return next((os.environ[name] for name in ADDRESS_ENV if os.environ.get(name)), None)


def require_cluster_address(explicit: str | None) -> str:
    address = cluster_address(explicit)
    if address is None:
        raise UserError(
            "no Ray cluster address: pass --address http://HEAD:8265 or set "
            "RAY_API_SERVER_ADDRESS (or RAY_ADDRESS)"
        )
    return address
