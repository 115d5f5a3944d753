"""The control plane's watch over worker leases.

Workers hold leases in Redis (``kervan:w:{id}``, renewed by their heartbeats). This
process declares a worker dead the moment its lease expires — Redis keyspace
notifications (``notify-keyspace-events Ex``, set here) say so at once — and has the
kv-registry purge it through its API (``PurgeExpired`` drops every expired worker
and its KV ownership), so that the scheduler, which reads the live set for every
placement, stops choosing it at once. A reconciliation loop every ``--interval``
seconds does the same whether or not a notification arrived: notifications are a
fast path, the loop is the source of truth (Redis does not queue notifications
for a subscriber that was disconnected).

Run as ``python -m control_plane.lease_watch``; ``watcher.py`` holds the watch itself."""
