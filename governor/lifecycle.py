"""App lifecycle as leases: a "background" report holds for a while, not forever.

Pure functions over an immutable tuple of leases; the governor keeps the tuple and the clock. A client that
reported background and then crashed, hung, or was only a fuzzer, stops pausing the server when its lease
runs out. Several clients: the server is in the background while ANY lease holds. A mobile app host (the
one client that really knows) renews its lease for as long as the app is in the background; pausing is
the safe side (no heat, no battery drain), and a stray client can keep the server paused for one TTL at
most, unless it keeps renewing, which the API key is there to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass

from governor.policy import Lifecycle


@dataclass(frozen=True)
class Lease:
    client: str
    expires_at: float  # on the governor's clock (wall time: clients renew on their own wall clocks)
    ttl_s: float


class TooManyLeases(Exception):
    """More distinct clients hold background leases than the governor keeps."""


# The rule table (one report or one clock reading at a time):
#
#   input                        client's lease before  -> after
#   background from C, ttl T     none or any            -> C's lease = now + T (a renewal is the same report)
#   background from new C        max_leases held        -> refused (TooManyLeases); nothing changes
#   foreground from C            held                   -> removed ("ended")
#   foreground from C            none                   -> unchanged (other clients' leases stand)
#   the clock reaches expires_at held                   -> removed ("expired")
#
#   lifecycle = background while any lease remains, else foreground.
def report(
    leases: tuple[Lease, ...],
    client: str,
    state: Lifecycle,
    now: float,
    ttl_s: float,
    max_leases: int,
) -> tuple[Lease, ...]:
    others = tuple(lease for lease in leases if lease.client != client)
    if state == "foreground":
        return others
    if len(others) == len(leases) and len(leases) >= max_leases:
        raise TooManyLeases(f"{len(leases)} clients already hold background leases")
    return (*others, Lease(client, now + ttl_s, ttl_s))


def expire(leases: tuple[Lease, ...], now: float) -> tuple[tuple[Lease, ...], tuple[Lease, ...]]:
    """(still held, expired) at `now`. A lease is over at its expiry instant."""
    held = tuple(lease for lease in leases if lease.expires_at > now)
    gone = tuple(lease for lease in leases if lease.expires_at <= now)
    return held, gone


def lifecycle_of(leases: tuple[Lease, ...]) -> Lifecycle:
    return "background" if leases else "foreground"
