"""The ``kervan`` command and the local cluster it starts: the commands (``commands.py``), the
launcher that runs every service as a process (``launcher.py``, with ``redis_server.py``,
``certificates.py``, ``port_reservations.py``, ``death_signal.py``), the readiness probe
(``probe.py``) and the gRPC client the commands and tools share (``client.py``). The
long-running control-plane services (``planner``, ``lease_watch``) import none of it."""
