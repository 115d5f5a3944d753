"""The scheduler's memory of what it placed between load reports."""

from services.scheduler.recent import RecentPlacements


def test_placements_count_until_the_window_passes():
    now = [100.0]
    recent = RecentPlacements(load_window_s=0.3, clock=lambda: now[0])
    recent.add("a", prefill_tokens=500, blocks=3)
    now[0] += 0.2
    recent.add("a", prefill_tokens=100)
    recent.add("b", blocks=7)
    assert recent.pending("a") == (600, 3) and recent.pending("b") == (0, 7) and recent.pending("c") == (0, 0)
    now[0] += 0.15  # the first placement of "a" is older than the window now
    assert recent.pending("a") == (100, 0)
    now[0] += 1.0
    assert recent.pending("a") == recent.pending("b") == (0, 0)


def test_placed_prompts_predict_the_workers_prefix_until_the_window_passes():
    now = [0.0]
    recent = RecentPlacements(prefix_window_s=2.0, clock=lambda: now[0])
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    recent.add("w", block_hashes=[a, b])
    now[0] = 1.5
    recent.add("w", block_hashes=[a, c])  # a is placed again: its clock restarts
    assert recent.predicted_blocks("w", [a, b, c]) == 3 and recent.predicted_blocks("w", [b, a]) == 2
    assert recent.predicted_blocks("v", [a]) == 0
    assert recent.sent_blocks("w") == 3 and recent.sent_blocks("v") == 0  # distinct blocks
    now[0] = 2.5  # b is older than the window now
    assert recent.predicted_blocks("w", [a, b]) == 1 and recent.predicted_blocks("w", [a, c]) == 2
    assert recent.sent_blocks("w") == 2
    now[0] = 10.0
    assert recent.predicted_blocks("w", [a]) == 0 and recent.sent_blocks("w") == 0
