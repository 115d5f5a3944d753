"""The engine: requests, the iteration scheduler, and the step loop."""
