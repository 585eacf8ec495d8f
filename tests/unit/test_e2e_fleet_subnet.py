"""Two e2e fleets on one machine (several test runs at once) take different /24s."""

from __future__ import annotations

import pytest

from tests.e2e.fleet import free_subnet

IP_ADDR = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever preferred_lft forever
"""


def test_the_preferred_subnet_when_nothing_holds_it():
    assert free_subnet("100.64.250", IP_ADDR) == "100.64.250"


def test_the_next_free_subnet_below_one_another_fleets_bridge_holds():
    held = IP_ADDR + "7: fab2971    inet 100.64.250.254/24 scope global fab2971\\       valid_lft forever preferred_lft forever\n"
    assert free_subnet("100.64.250", held) == "100.64.249"
    both = held + "9: fab3012    inet 100.64.249.254/24 scope global fab3012\\       valid_lft forever preferred_lft forever\n"
    assert free_subnet("100.64.250", both) == "100.64.248"


def test_no_free_subnet_is_an_error_listing_what_is_held():
    held = "".join(f"{n}: fab{n}    inet 100.64.{n}.254/24 scope global\n" for n in range(200, 251))
    with pytest.raises(RuntimeError, match="no free /24 from 100.64.250 down"):
        free_subnet("100.64.250", held)
