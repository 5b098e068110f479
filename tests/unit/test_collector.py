"""data_plane/collector.py: the collector held off while loading, what loading made frozen before serving (or
before an in-process bench's steps), and unfrozen again at the end."""
import gc

from data_plane import collector


class Loaded:
    """A tracked object, as a model's loading makes (a dict of plain values may be untracked by a pass)."""


def test_hold_settle_release_and_serving():
    was_enabled = gc.isenabled()
    try:
        collector.hold()
        assert not gc.isenabled()
        made_while_loading = [Loaded() for _ in range(1000)]
        collector.settle()
        assert gc.isenabled()
        frozen = gc.get_freeze_count()
        assert frozen >= len(made_while_loading)
        # frozen objects are out of reach of every generation's pass
        assert not any(o is made_while_loading[0] for o in gc.get_objects())
        collector.release()
        assert gc.get_freeze_count() == 0
        assert any(o is made_while_loading[0] for o in gc.get_objects())

        collector.hold()
        with collector.serving():
            assert gc.isenabled() and gc.get_freeze_count() >= len(made_while_loading)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()
