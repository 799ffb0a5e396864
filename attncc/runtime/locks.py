"""attncc's locks, made fresh in a forked child.

A lock that another thread holds when the process forks stays held in the child for good (the
thread that would release it does not exist there): a worker forked while a server thread built
a kernel hung on that kernel's lock. Every lock in attncc is made here, and the child of a fork
replaces each with a new one (`os.register_at_fork`).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

#: Objects whose `_lock` attribute is one of these locks (weakly: a freed kernel is forgotten).
_HOLDERS: weakref.WeakSet[object] = weakref.WeakSet()
#: (module name, attribute) of module-level locks.
_MODULE_LOCKS: list[tuple[str, str]] = []


def instance_lock(holder: object) -> threading.Lock:
    """A lock for `holder._lock`, renewed in a forked child."""
    _HOLDERS.add(holder)
    return threading.Lock()


def module_lock(module: str, attribute: str) -> threading.Lock:
    """A lock for the module-level name `module.attribute`, renewed in a forked child."""
    _MODULE_LOCKS.append((module, attribute))
    return threading.Lock()


def _renew_in_child() -> None:
    for holder in list(_HOLDERS):
        holder._lock = threading.Lock()  # type: ignore[attr-defined]
    for module, attribute in _MODULE_LOCKS:
        setattr(sys.modules[module], attribute, threading.Lock())


os.register_at_fork(after_in_child=_renew_in_child)
