"""The scheduler's memory of what it placed between load reports."""

from services.scheduler.recent import RecentPlacements


def test_placements_count_until_the_window_passes():
    now = [100.0]
    recent = RecentPlacements(window_s=0.3, clock=lambda: now[0])
    recent.add("a", prefill_tokens=500, blocks=3)
    now[0] += 0.2
    recent.add("a", prefill_tokens=100)
    recent.add("b", blocks=7)
    assert recent.pending("a") == (600, 3) and recent.pending("b") == (0, 7) and recent.pending("c") == (0, 0)
    now[0] += 0.15  # the first placement of "a" is older than the window now
    assert recent.pending("a") == (100, 0)
    now[0] += 1.0
    assert recent.pending("a") == recent.pending("b") == (0, 0)
