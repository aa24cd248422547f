"""Which waiting request takes the next free place beside the replies running now (a batch's row, or a
turn: models/runtime/turns.py), so that one client's ten requests do not starve another's one.

A client is who sent the request: the API key it presented (with SIMMER_API_KEY set: every holder of one
key is one client), else the peer's address. Two tools of one user on one device (loopback, no key) are
one client: their requests go in queue order, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def client_of(*, api_key_set: bool, authorization: str | None, peer: str | None) -> str:
    """The client a request is, for its turn (a key enters only as a hash, as in cache_scope)."""
    if api_key_set and authorization:
        key = authorization.partition(" ")[2].strip()
        return "key:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return "peer:" + (peer or "")


# The next of the waiting requests (their clients in queue order) given how many replies each client has
# running now:
#   the client with the fewest replies running        -> its request goes first
#   clients with as many running                      -> the one whose request has waited longest
#   one client's requests                             -> in their queue order
# So a client with none running goes before one with three, however many that one has queued; two clients
# that both wait alternate, one reply each; a lone client is served in queue order (plain FIFO).
def next_turn(waiting: Sequence[str], running: Mapping[str, int]) -> int | None:
    """The index in `waiting` of the request that goes next (None: nobody waits)."""
    best: tuple[int, int] | None = None
    chosen = None
    for i, client in enumerate(waiting):
        key = (running.get(client, 0), i)
        if best is None or key < best:
            best, chosen = key, i
    return chosen
