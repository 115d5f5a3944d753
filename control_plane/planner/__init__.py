"""The SLA planner: pools that scale themselves to TTFT and ITL targets (NVIDIA Dynamo's
planner, on Kervan's metrics and ``kervan plan``'s arithmetic).

    metrics.py     scrape the router and workers; an interval's observation
    predictor.py   the next interval's load
    policy.py      how many prefill and decode workers it needs (bounds, cool-downs)
    scaler.py      the launcher's workers, or Kubernetes Deployments' scale subresource
    sla_planner.py the loop, and its log
    options.py     the flags ``kervan up --planner`` and ``python -m control_plane.planner`` share"""
