"""A simulated host's link (``control_plane/hosts/link.py``): the figure ``--link`` reads and the
``tc`` commands that give a device its shape and its faults (run on real namespaces by
``tests/multihost/``; here, what they say)."""

from __future__ import annotations

import pytest

from control_plane.hosts.link import DROP_CLASS, Link, LinkError, drop_filter, loss_filter, shape_commands


@pytest.mark.parametrize("text,rate,delay", [("1gbit", 10**9, 0.0), ("100mbit,2ms", 10**8, 0.002),
                                             ("10G", 10**10, 0.0), ("unshaped", None, 0.0),
                                             ("2.5gbps,500us", 25 * 10**8, 0.0005)])
def test_a_link_reads_a_rate_and_a_delay(text, rate, delay):
    link = Link.parse(text)
    assert (link.rate_bits, link.delay_s) == (rate, delay)
    assert Link.parse(str(link)) == link


@pytest.mark.parametrize("text,words", [("fast", "not a rate"), ("1gbit,soon", "not a time"),
                                        ("10bit", "below 1 kbit/s")])
def test_a_link_that_cannot_be_read_is_refused_naming_what(text, words):
    with pytest.raises(LinkError, match=words):
        Link.parse(text)


def test_every_device_gets_a_rate_class_and_a_drop_class_and_netem_only_for_a_delay():
    plain = shape_commands("eth0", Link.parse("1gbit"))
    assert any("1000000000bit" in argv for argv in plain) and not any("netem" in argv for argv in plain)
    assert any(argv[-3:] == ["pfifo", "limit", "0"] for argv in plain)  # the drop class drops everything
    assert any("netem" in argv for argv in shape_commands("eth0", Link.parse("1gbit,2ms")))


def test_faults_send_packets_to_the_drop_class():
    assert drop_filter("eth0", 1)[-2:] == ["flowid", DROP_CLASS]
    assert "match ip dst 10.0.0.2/32".split() == drop_filter("eth0", 2, "ip dst 10.0.0.2/32")[12:16]
    bpf = loss_filter("eth0", 4, 0.1)
    code = bpf[bpf.index("bytecode") + 1].split(",")
    assert code[0] == "4" and code[2] == f"37 1 0 {int(0.1 * 2**32)}"  # jgt threshold: a tenth matches
    with pytest.raises(LinkError):
        loss_filter("eth0", 4, 1.5)
