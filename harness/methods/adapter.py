"""A plugin that writes role hooks on its :class:`~harness.methods.base.Method` subclass
without declaring the roles keeps working for this release.

Such a class (``class Old(Method)`` with a ``rerank_similarity`` and a ``rerank_fields``)
defines some members of a role of :mod:`harness.methods.roles` but not the role. Building
the class takes the role's defaults for the members it lacks, so that it has the role as
the engine asks for it (``isinstance(head, Reranker)``), and warns with a
``DeprecationWarning`` naming the role to declare instead.
"""

from __future__ import annotations

import warnings

from harness.methods.roles import ROLES, role_members

__all__ = ["adapt_role_hooks", "undeclared_roles"]


def undeclared_roles(cls: type) -> dict[type, list[str]]:
    """Each role of which ``cls`` defines a member of its own (one no other role has, so
    ``rerank_fields`` alone makes no :class:`~harness.methods.roles.PairScorer`) without
    subclassing it, with the members of the role it defines."""
    found = {}
    for role in ROLES:
        if role in cls.__mro__:
            continue
        others = {m for r in ROLES if r is not role for m in role_members(r)}
        written = [m for m in role_members(role) if hasattr(cls, m)]
        if not set(written) - others:
            continue
        if written:
            found[role] = written
    return found


def adapt_role_hooks(cls: type) -> None:
    """Give ``cls`` the defaults of each role it writes hooks of without declaring, and warn."""
    found = undeclared_roles(cls)
    for role, written in found.items():
        for member in role_members(role):
            if member not in written and member in vars(role):
                setattr(cls, member, vars(role)[member])
    if found:
        names = ", ".join(r.__name__ for r in found)
        hooks = ", ".join(sorted({m for w in found.values() for m in w}))
        warnings.warn(
            f"{cls.__qualname__} writes the hooks {hooks} on Method without declaring their "
            f"roles; the roles' defaults fill the rest for this release. Declare them instead: "
            f"class {cls.__name__}(Method, {names}) with {names} from harness.methods.roles",
            DeprecationWarning,
            stacklevel=4,
        )
