"""ops/linear.onednn_amx: AMX tiles count only where oneDNN may take them, so that a CPU with AMX held to
AVX512-BF16 (`make test-avx512`) takes the routes of a CPU without them."""
import pytest
import torch

from ops import linear


class _Kernel:
    def has_bf16_dot(self):
        return True


def _cpu(monkeypatch, tiles: bool, held: str | None):
    """A CPU that has AMX tiles or not, oneDNN held to `held` (None: not held)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles)
    if held is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", held)


@pytest.mark.parametrize("held, tiles", [(None, True), ("", True), ("ALL", True), ("avx512_core_amx", True),
                                         ("AVX512_CORE_AMX_FP16", True), ("AVX512_CORE_BF16", False),
                                         ("avx512_core_vnni", False), ("AVX2", False)])
def test_a_cpu_with_tiles_takes_them_unless_onednn_is_held_below_them(monkeypatch, held, tiles):
    _cpu(monkeypatch, True, held)
    assert linear.onednn_amx() is tiles
    # the AVX512-BF16 kernel's route is taken exactly where the tiles are not
    assert linear.bf16_dot_kernel(_Kernel()) is (not tiles)


@pytest.mark.parametrize("held", [None, "ALL", "AVX512_CORE_AMX"])
def test_a_cpu_without_tiles_never_takes_them(monkeypatch, held):
    _cpu(monkeypatch, False, held)
    assert linear.onednn_amx() is False
    assert linear.bf16_dot_kernel(_Kernel()) is True
    assert linear.bf16_dot_kernel(None) is False
