"""The order in which waiting requests get a sequence (appliance/daemon/admission.py): round-robin over keys,
first come first served within a key. Pure."""

from __future__ import annotations

from appliance.daemon.admission import Admission


def drain(admission: Admission, keys: dict[object, str]) -> list[str]:
    """Start the head until nobody waits; the keys in the order they started."""
    order = []
    while admission.head() is not None:
        ticket = admission.head()
        order.append(keys[ticket])
        admission.leave(keys[ticket], ticket)
    return order


def test_a_key_with_many_tickets_waits_its_turn_like_everyone_else() -> None:
    admission = Admission()
    keys: dict[object, str] = {}
    for _ in range(5):
        ticket = object()
        keys[ticket] = "hog"
        admission.join("hog", ticket)
    for name in ("a", "b"):
        ticket = object()
        keys[ticket] = name
        admission.join(name, ticket)
    assert admission.waiting == 7
    assert drain(admission, keys) == ["hog", "a", "b", "hog", "hog", "hog", "hog"]
    assert admission.waiting == 0 and admission.head() is None


def test_a_ticket_that_gives_up_leaves_without_taking_the_turn() -> None:
    admission = Admission()
    first, second, other = object(), object(), object()
    admission.join("x", first)
    admission.join("x", second)
    admission.join("y", other)
    admission.leave("x", second)  # not the head: the ring does not move
    assert admission.head() is first
    admission.leave("x", first)
    assert admission.head() is other and admission.waiting == 1


def test_the_turn_is_the_start_order_as_far_as_there_are_free_sequences() -> None:
    """:meth:`Admission.turn` lists the tickets that try at once: the first ``count`` of the order :func:`drain`
    starts them in (round-robin over keys from the head's), always the head, never more tickets than wait."""
    admission = Admission()
    keys: dict[object, str] = {}
    tickets: dict[str, list[object]] = {"hog": [], "a": [], "b": []}
    for name in ("hog", "hog", "hog", "a", "b", "b"):
        ticket = object()
        keys[ticket] = name
        tickets[name].append(ticket)
        admission.join(name, ticket)
    order = [tickets["hog"][0], tickets["a"][0], tickets["b"][0], tickets["hog"][1], tickets["b"][1],
             tickets["hog"][2]]
    assert admission.turn(0) == [admission.head()] == order[:1]
    assert admission.turn(3) == order[:3]
    assert admission.turn(100) == order
    assert [keys[ticket] for ticket in order] == drain(admission, keys)
    assert admission.turn(4) == []
