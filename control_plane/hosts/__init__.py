"""Several hosts on one machine: network namespaces joined by a shaped switch, and the faults
only a network has (``network.py``), for ``kervan up --hosts`` and the multi-host tests."""
