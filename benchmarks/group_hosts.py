"""Worker groups across hosts: the decode step of a group of two ranks whose ranks sit on two
simulated hosts joined by a shaped link, against the same group on one host.

Three settings, each a fresh process per round: ``one_host_shm`` (the ranks on one host, the
collectives and hand-overs through shared memory: what a group does by default), ``one_host_gloo``
(one host, no shared memory: everything on gloo over loopback) and ``two_hosts`` (rank 0 on one
simulated host, rank 1 on another, gloo over the link: ``kervan up --hosts``'s layout, at each
``--links`` rate). Each runs ``benchmarks.parallel.run`` on the 125M-parameter Llama: decode
step time per batch bucket (the median of ``--steps`` steps after warm-up) and the bytes rank 0
sent between the ranks per token. Reported per setting and bucket: the step time (median over
``--rounds`` rounds, with the range), and against ``one_host_shm`` in the same round, the
communication's share of the step (``1 - shm step / step``); per link, the time the step's bytes
would take on the link alone (the bound the link sets). Tensor and pipeline parallel, float32.

    python -m benchmarks.group_hosts --json-out benchmarks/results/group_hosts-avx2-epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.machine import machine, write_report
from benchmarks.models import ensure_random_model
from benchmarks.stats import spread
from control_plane.hosts.link import Link
from control_plane.hosts.network import HostNetwork
from kervan.envs import KERVAN_GROUP_PEER_HOSTS

CHILD = """
import json, sys
from benchmarks.parallel import run
args = json.loads(sys.argv[1])
print(json.dumps(run(args["model"], "float32", args["buckets"], args["steps"], 1, args["vocab"],
                     **{args["layout"] + "_parallel_size": 2})))
"""


def child(argv_prefix: list[str], env: dict[str, str], args: dict) -> dict:
    root = str(Path(__file__).resolve().parents[1])  # entering a host's mounts leaves the working directory
    out = subprocess.run([*argv_prefix, sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                         text=True, timeout=900, env={**os.environ, **env, "PYTHONPATH": root}, cwd=root)
    if out.returncode:
        raise RuntimeError(f"the group run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def settings(links: list[str]) -> list[str]:
    return ["one_host_shm", "one_host_gloo", *(f"two_hosts_{link}" for link in links)]


def measure(setting: str, args: dict) -> dict:
    if setting == "one_host_shm":
        return child([], {}, args)
    if setting == "one_host_gloo":
        return child([], {KERVAN_GROUP_PEER_HOSTS: "[[]]"}, args)
    link = setting.removeprefix("two_hosts_")
    with HostNetwork.create(2, Link.parse(link)) as net:
        here, there = net.hosts
        return child(here.enter([]), {KERVAN_GROUP_PEER_HOSTS: json.dumps([there.enter([])]),
                                      "GLOO_SOCKET_IFNAME": "eth0"}, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--buckets", default="1,8")
    ap.add_argument("--layouts", default="tensor,pipeline")
    ap.add_argument("--links", default="1gbit,10gbit")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    model = str(ensure_random_model(args.vocab_size, "125m"))
    buckets = [int(b) for b in args.buckets.split(",")]
    links = args.links.split(",")
    results: dict = {}
    for layout in args.layouts.split(","):
        runs: dict[str, list[dict]] = {s: [] for s in settings(links)}
        for r in range(args.rounds):
            order = settings(links) if r % 2 == 0 else list(reversed(settings(links)))
            for setting in order:
                runs[setting].append(measure(setting, {"model": model, "buckets": buckets, "steps": args.steps,
                                                       "vocab": args.vocab_size, "layout": layout}))
                print(f"{layout} round {r} {setting}: {runs[setting][-1]['decode_step_ms']}", file=sys.stderr,
                      flush=True)
        results[layout] = summarize(runs, links)
    report = {"benchmark": "group_hosts", "model": "random 125M Llama (benchmarks/models.py '125m')",
              "machine": machine("float32"), "arguments": vars(args), "summary": results}
    write_report(report, args.json_out)


def summarize(runs: dict[str, list[dict]], links: list[str]) -> dict:
    out: dict = {}
    shm = runs["one_host_shm"]
    for setting, outs in runs.items():
        per_bucket = {}
        for b in outs[0]["decode_step_ms"]:
            step = [o["decode_step_ms"][b] for o in outs]
            entry = {"decode_step_ms": spread(step)}
            if setting != "one_host_shm":
                entry["communication_share"] = spread([1 - s["decode_step_ms"][b] / ms for s, ms in zip(shm, step)])
            traffic = [sum(o.get("bytes_between_ranks_per_token", {}).get(b, {}).values()) * int(b) for o in outs]
            rate = Link.parse(setting.removeprefix("two_hosts_")).bytes_per_s if setting.startswith("two") else None
            if rate and any(traffic):  # what the step's bytes take on the link alone, each way
                entry["bytes_between_ranks_per_step"] = spread(traffic)
                entry["link_alone_ms"] = spread([t / rate * 1e3 for t in traffic])
            per_bucket[b] = entry
        out[setting] = per_bucket
    return out


if __name__ == "__main__":
    main()
