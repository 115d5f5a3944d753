"""Kervan's control plane: membership, failover, the local launcher and the ``kervan`` CLI."""
