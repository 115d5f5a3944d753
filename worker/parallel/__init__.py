"""Process groups and collectives for tensor and expert parallelism."""

from worker.parallel.state import ParallelState, all_gather_last_dim, all_reduce, get_parallel_state

__all__ = ["ParallelState", "all_gather_last_dim", "all_reduce", "get_parallel_state"]
