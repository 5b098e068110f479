"""Python's garbage collector over a data plane's life. Loading makes hundreds of thousands of objects
(the model and whatever its loading made) that all live as long as the process: the collector is held
off while they are made, and they are frozen, out of its reach, before serving, so that a full collection
walks only what serving made since instead of stalling a step for a walk over all of them."""
from __future__ import annotations

import contextlib
import gc


def hold() -> None:
    """Before loading: no collections until `serving` (each pass would walk the new objects for nothing)."""
    gc.disable()


def settle() -> None:
    """After loading: what it left is frozen, and the collector runs again. An in-process bench that
    builds the data plane's runner calls this too (bench/_common.default_runner): its steps are then timed
    with the collections the data plane has, not with full passes over a model it never frees."""
    gc.collect()
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def serving():
    """Around the serving loop: `settle`, and at the end the objects are unfrozen, within reach of the
    interpreter's last collection: extension objects it never frees are reported as leaks at exit
    (nanobind's, Triton's)."""
    settle()
    try:
        yield
    finally:
        release()


def release() -> None:
    """What `settle` froze is within the collector's reach again."""
    gc.unfreeze()
