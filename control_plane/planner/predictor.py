"""The next interval's value of a load series (request rate, prompt length, output length)
from the intervals seen so far. Two, both stated in full here:

- ``constant``: the next interval is the last one (Dynamo's planner's simplest choice);
- ``trend``: the least-squares line through the last ``window`` intervals, one interval
  ahead, never below zero: a ramp is met one interval early, at the price of overshooting
  when it turns;
- ``average``: the mean of the last ``window`` intervals (what the planner always uses for
  prompt and output lengths: an interval's mean output length is noisy, its tokens
  streamed in one interval and its requests finishing in the next).

A new predictor is a class with ``add`` and ``predict`` and a line in ``PREDICTORS``."""

from __future__ import annotations

from collections import deque


class Constant:
    def __init__(self) -> None:
        self.last: float | None = None

    def add(self, value: float) -> None:
        self.last = value

    def predict(self) -> float | None:
        return self.last


class Window:
    """The last ``window`` intervals' values."""

    def __init__(self, window: int = 4) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self.values.append(value)


class Trend(Window):
    def predict(self) -> float | None:
        n = len(self.values)
        if n == 0:
            return None
        if n == 1:
            return self.values[0]
        mean_x, mean_y = (n - 1) / 2, sum(self.values) / n
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in enumerate(self.values))
                 / sum((x - mean_x) ** 2 for x in range(n)))
        return max(0.0, mean_y + slope * (n - mean_x))


class Average(Window):
    def predict(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None


PREDICTORS = {"constant": Constant, "trend": Trend, "average": Average}
