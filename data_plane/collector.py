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


@contextlib.contextmanager
def serving():
    """Around the serving loop: what loading left is frozen, the collector runs again; at the end the
    objects are unfrozen, within reach of the interpreter's last collection: extension objects it never
    frees are reported as leaks at exit (nanobind's, Triton's)."""
    gc.collect()
    gc.freeze()
    gc.enable()
    try:
        yield
    finally:
        gc.unfreeze()
