"""The errors the registry and phaze's broker raise through reconciler.ports.

Standard library only, and re-exported by reconciler.ports (the same
classes): a memoized pass catches them without importing the ports'
Protocols (tests/unit/test_pass_memo.py checks what it imports).
"""

from __future__ import annotations


class RegistryError(Exception):
    """Something the registry refused or could not do."""


class RegistryUnavailable(RegistryError):
    """The registry cannot be reached (no etcd endpoint answers, the sqlite file
    cannot be opened or stays locked). Callers fail static: keep what runs."""


class NotLeader(RegistryError):
    """A write that needs leadership was refused: the caller's term is over
    (its lease lapsed, or another candidate leads now)."""


class PermissionDenied(RegistryError):
    """The registry refused this identity the operation (etcd with auth on: a
    host writing another host's keys, a non-candidate writing the leader's).
    Retrying does not help: the certificate or `fabric registry init-auth` must change."""


class LaneBrokerError(Exception):
    """The lane queue refused or could not do something; the message says what."""


class LaneBrokerUnavailable(LaneBrokerError):
    """The broker cannot be reached (PostgreSQL down, the DSN file unreadable):
    jobs wait meanwhile."""


class StaleDispatcher(LaneBrokerError):
    """A dispatch carried a term that is not the registry's current one (read
    inside the dispatch's transaction): a newer leader's dispatcher runs, or
    will, and this one must stop."""
