"""The plain method as a test plugin, registered for one test under a name of its own
(:meth:`harness.base.registry.Registry.temporarily`), as its code stood before and after a
change to what it computes: ``revision`` 1 (:class:`~harness.methods.plain.PlainHead`),
then 2 (:class:`RevisedPlainHead`)."""

from __future__ import annotations

from contextlib import AbstractContextManager

from harness.methods import METHODS
from harness.methods.base import MethodEntry
from harness.methods.plain import PlainHead

#: The name the test plugin is registered under.
PLAIN_TEST = "plain-test"


class RevisedPlainHead(PlainHead):
    """plain after a change to what it computes: its revision bumped to 2 (test only)."""

    revision = 2


def plain_test(cls: type[PlainHead] = PlainHead) -> AbstractContextManager[MethodEntry]:
    """``with plain_test(cls):``: ``cls`` registered as :data:`PLAIN_TEST` for the block."""
    return METHODS.temporarily(PLAIN_TEST, MethodEntry(PLAIN_TEST, cls, {}))
