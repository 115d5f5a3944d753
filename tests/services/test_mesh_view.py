"""The mesh page's sources apart from a cluster: the router's journal keeps its newest
placements and migrations first and no more than its bound, and a view whose registry is
not given names it as unavailable instead of failing; a worker's ``auto`` advertised address
is its own address on the route to the registry."""

from __future__ import annotations

from services.common.advertise import advertised
from services.router.mesh_journal import MeshJournal
from services.router.mesh_view import MeshView


def test_the_journal_keeps_the_newest_first_and_no_more_than_its_bound():
    journal = MeshJournal(size=3)
    for i in range(5):
        journal.placed(f"r{i}", "", "10.0.0.1:1", "10.0.0.2:1", "remote")
    journal.migrated("r4", "10.0.0.2:1", "stream stalled", 7)
    recent = journal.recent()
    assert [e["request_id"] for e in recent["placements"]] == ["r4", "r3", "r2"]
    assert recent["migrations"] == [{**recent["migrations"][0], "request_id": "r4", "worker": "10.0.0.2:1",
                                     "reason": "stream stalled", "delivered": 7}]


async def test_a_view_without_a_registry_says_so_and_shows_the_rest():
    journal = MeshJournal()
    journal.placed("r0", "10.0.0.3:1", "", "", "short")
    state = await MeshView("m", journal).state(in_flight=2)
    assert state["workers"] == [] and state["unavailable"] == ["kv-registry (the router was not given --registry)"]
    assert state["router"] == {"in_flight": 2} and state["placements"][0]["worker"] == "10.0.0.3:1"


def test_an_auto_address_is_this_machine_s_on_the_route_to_the_registry():
    assert advertised("auto:50060", "127.0.0.1:50051") == "127.0.0.1:50060"
    assert advertised("decode:50060", "127.0.0.1:50051") == "decode:50060"  # anything else as given
