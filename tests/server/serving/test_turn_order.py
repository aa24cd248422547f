"""Which waiting request goes next beside the replies running (server/serving/turn_order.py), row by row of
its rule table."""

from __future__ import annotations

import pytest

from server.serving.turn_order import client_of, next_turn


@pytest.mark.parametrize(
    ("waiting", "running", "chosen"),
    [
        # nobody waits
        ([], {}, None),
        ([], {"a": 3}, None),
        # one client's requests: in queue order (plain FIFO)
        (["a", "a", "a"], {}, 0),
        (["a", "a", "a"], {"a": 4}, 0),
        # the client with the fewest running goes first, however many the other has queued
        (["a"] * 9 + ["b"], {"a": 1}, 9),
        (["a"] * 9 + ["b"], {"a": 3, "b": 1}, 9),
        (["a", "b", "c"], {"a": 2, "b": 1}, 2),
        # as many running: the one whose request waited longest
        (["b", "a"], {"a": 1, "b": 1}, 0),
        (["a", "b"], {}, 0),
        # a client with more running waits, even at the head of the queue
        (["a", "a", "b"], {"a": 2, "b": 1}, 2),
        (["b", "a"], {"b": 2}, 1),
    ],
)
def test_next_turn_when_clients_wait_then_the_fewest_running_first_then_the_oldest(waiting, running, chosen):
    assert next_turn(waiting, running) == chosen


def test_next_turn_when_two_clients_keep_waiting_then_they_alternate_one_reply_each():
    """Ten of a's requests and three of b's, two places: replayed as the worker does (a request that joins
    runs until the end; here every running reply ends after the next joins)."""
    queue = ["a"] * 10 + ["b"] * 3
    running = {"a": 1}  # a's first holds the worker
    order = []
    while queue:
        i = next_turn(queue, running)
        assert i is not None
        client = queue.pop(i)
        order.append(client)
        running = {client: 1}  # the other one's reply ended
    assert order[:6] == ["b", "a", "b", "a", "b", "a"]


@pytest.mark.parametrize(
    ("api_key_set", "authorization", "peer", "same_as"),
    [
        (True, "Bearer k1", "10.0.0.1", (True, "Bearer k1", "10.0.0.2")),  # one key, two machines: one client
        (False, "Bearer k1", "10.0.0.1", (False, "Bearer k2", "10.0.0.1")),  # no key set: the peer
        (False, None, "127.0.0.1", (False, None, "127.0.0.1")),
    ],
)
def test_client_of_when_a_key_is_set_then_the_key_else_the_peer(api_key_set, authorization, peer, same_as):
    mine = client_of(api_key_set=api_key_set, authorization=authorization, peer=peer)
    key_set, other_auth, other_peer = same_as
    assert mine == client_of(api_key_set=key_set, authorization=other_auth, peer=other_peer)
    assert "k1" not in mine  # a key only as a hash


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((True, "Bearer k1", "10.0.0.1"), (True, "Bearer k2", "10.0.0.1")),  # two keys: two clients
        ((False, None, "10.0.0.1"), (False, None, "10.0.0.2")),  # two peers
        ((True, "Bearer k1", "10.0.0.1"), (True, None, "10.0.0.1")),  # a key and none
    ],
)
def test_client_of_when_keys_or_peers_differ_then_two_clients(a, b):
    first = client_of(api_key_set=a[0], authorization=a[1], peer=a[2])
    assert first != client_of(api_key_set=b[0], authorization=b[1], peer=b[2])
