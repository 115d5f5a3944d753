"""A link's shape and the ``tc`` commands that give a device that shape.

Each device gets an HTB root with two classes: ``1:1`` carries the traffic at the link's rate
(with netem's delay beneath it where the kernel has netem), ``1:2`` drops everything put in it
(a ``pfifo`` of length 0). A fault is a filter that moves packets into ``1:2``: all of them (a host
cut off), those to or from one address or port (a partition, Redis out of reach), or a random
share of them (a lossy link: a classic-BPF classifier on the kernel's random number, which works
on kernels built without netem, as the ones here are)."""

from __future__ import annotations

import re
from dataclasses import dataclass

UNSHAPED_BITS = 100 * 10**9  # "unshaped": a rate above what the veth carries here (~10 Gbit/s)
DROP_CLASS = "1:2"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit|b)?(?:/s|ps)?$", re.IGNORECASE)
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$")


class LinkError(ValueError):
    """A link figure that cannot be read."""


@dataclass(frozen=True)
class Link:
    """A host's link to the switch, the same both ways: ``rate_bits`` per second (None:
    unshaped) and a one-way ``delay_s`` (0: none; needs netem)."""

    rate_bits: int | None = None
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Link:
        """``RATE[,DELAY]``: ``1gbit``, ``100mbit,2ms``, ``unshaped``."""
        rate_text, _, delay_text = text.strip().partition(",")
        rate = None
        if rate_text.lower() not in ("", "unshaped", "none"):
            m = _RATE.match(rate_text.strip())
            if m is None:
                raise LinkError(f"link rate {rate_text!r} is not a rate like 1gbit, 100mbit or 10g")
            rate = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if rate < 1000:
                raise LinkError(f"link rate {rate_text!r} is below 1 kbit/s")
        delay = 0.0
        if delay_text:
            m = _DELAY.match(delay_text.strip())
            if m is None:
                raise LinkError(f"link delay {delay_text!r} is not a time like 2ms or 500us")
            delay = float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
        return cls(rate, delay)

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.rate_bits is None else self.rate_bits / 8

    def __str__(self) -> str:
        rate = "unshaped" if self.rate_bits is None else f"{self.rate_bits / 1e6:g}mbit"
        return rate + (f",{self.delay_s * 1e3:g}ms" if self.delay_s else "")


def shape_commands(dev: str, link: Link) -> list[list[str]]:
    """The ``tc`` argv lists that give ``dev`` the link's shape and the drop class."""
    rate = link.rate_bits or UNSHAPED_BITS
    # a 2 ms burst at the rate (never below 64 KiB): TCP's segments of 64 KiB (GSO) pass whole
    burst = max(64 << 10, int(rate / 8 * 0.002))
    quantum = min(200_000, max(1514, rate // 8 // 1000))
    cmds = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
            ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{rate}bit",
             "burst", str(burst), "cburst", str(burst), "quantum", str(quantum)],
            ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", DROP_CLASS, "htb", "rate", "8kbit",
             "quantum", "1514"],
            ["tc", "qdisc", "add", "dev", dev, "parent", DROP_CLASS, "handle", "2:", "pfifo", "limit", "0"]]
    if link.delay_s:
        cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                     f"{link.delay_s * 1e6:.0f}us", "limit", "100000"])
    return cmds


def drop_filter(dev: str, prio: int, *matches: str, protocol: str = "ip") -> list[str]:
    """Packets matching every u32 ``matches`` (e.g. ``ip dst 10.0.0.2/32``) go to the drop
    class; no ``matches``: every packet."""
    terms = [w for m in matches for w in ["match", *m.split()]] or ["match", "u32", "0", "0"]
    return ["tc", "filter", "add", "dev", dev, "parent", "1:", "prio", str(prio), "protocol", protocol, "u32",
            *terms, "flowid", DROP_CLASS]


def loss_filter(dev: str, prio: int, fraction: float) -> list[str]:
    """A random ``fraction`` of IP packets to the drop class: classic BPF, ``A = random; if A
    <= threshold: match``."""
    if not 0.0 < fraction < 1.0:
        raise LinkError(f"a packet loss must be in (0, 1), got {fraction}")
    ad_random = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM: load a random 32-bit number
    threshold = int(fraction * 2**32)
    program = [(0x20, 0, 0, ad_random),  # ld  [rand]
               (0x25, 1, 0, threshold),  # jgt #threshold -> no match
               (0x06, 0, 0, 0xFFFFFFFF),  # ret -1: the filter's class (drop)
               (0x06, 0, 0, 0)]  # ret 0: no match
    code = ",".join([str(len(program)), *(" ".join(map(str, insn)) for insn in program)])
    return ["tc", "filter", "add", "dev", dev, "parent", "1:", "prio", str(prio), "protocol", "ip", "bpf",
            "bytecode", code, "classid", DROP_CLASS]
