"""The KV pool holds one K/V slab per attention layer, none for a state layer (data_plane/kv_pool.py): a
hybrid model's budget in bytes buys blocks for its attention layers only, every slab is the one its layer
writes, and what the handshake and the metrics say the pool holds is what was allocated. A model whose
every layer attends keeps one slab per layer, in layer order; a model none of whose layers attends (Mamba)
has a pool of no slab. Token identity of these models: tests/integration/test_architectures.py."""
from __future__ import annotations

import pytest
import torch

from control_plane.preemption import PreemptionPolicy
from data_plane import attention, kv_pool, metrics, model_support
from data_plane.kv_pool import GIB
from data_plane.model_runner import ModelRunner
from data_plane.state_pool import DEFAULT_NUM_SLOTS
from shared.config import DataPlaneConfig, kv_block_bytes
from shared.protocol import NewSequence, SamplingSpec, StepPlan
from tests.architectures import SUPPORTED, build

BLOCK_SIZE = 4
LFM2 = "LFM2 (short convolutions on the state pool, attention)"   # layers conv, attention, conv
JAMBA = "Jamba (Mamba with norms and attention, MoE)"              # layers Mamba, attention
BAMBA = "Bamba (Mamba2 and attention)"                             # layers Mamba2, attention
PROMPT = [1] + list(range(40, 50))    # 11 tokens: blocks 0-2


def _runner(name: str, blocks_of_every_layer: int) -> tuple[ModelRunner, int]:
    """The model's runner on a budget in bytes of exactly `blocks_of_every_layer` blocks counted with a
    K/V slab for every layer, as the pool was sized before; returns it and the bytes of one layer's block."""
    model = build(SUPPORTED[name], "eager")
    model.set_attn_implementation(attention.register())
    config = model.config
    layer_bytes = kv_block_bytes(1, BLOCK_SIZE, model_support.kv_heads(config), model_support.head_dim(config),
                                 "float32")
    budget = blocks_of_every_layer * config.num_hidden_layers * layer_bytes
    dp = DataPlaneConfig(model="tiny", listen="inproc://x", block_size=BLOCK_SIZE, kv_cache_gib=budget / GIB,
                         swap_blocks=0)
    return ModelRunner(model, dp, torch.device("cpu")), layer_bytes


def _stated_bytes(runner: ModelRunner) -> tuple[int, float]:
    """What the control plane computes as one block's bytes from the handshake, and what the data plane's
    metrics say the device pool holds."""
    hs = runner.handshake()
    stats = metrics.DataPlaneStats(hs)
    pool_bytes = stats.registry.get_sample_value("pagedserve_data_plane_kv_pool_bytes",
                                                 {"model_name": stats.model_name, "pool": "device"})
    return PreemptionPolicy.block_bytes_of(hs), pool_bytes


@pytest.mark.parametrize("name,attending", [(LFM2, [1]), (JAMBA, [1]), (BAMBA, [1])])
def test_a_hybrid_models_pool_holds_its_attention_layers_only(name, attending):
    runner, layer_bytes = _runner(name, blocks_of_every_layer=40)
    config = runner.model.config
    num_layers = config.num_hidden_layers
    assert model_support.attention_layers(config) == attending
    # the budget that bought 40 blocks of every layer's K/V buys num_layers / len(attending) times as many
    blocks = 40 * num_layers // len(attending)
    assert runner.num_blocks == blocks
    assert tuple(runner.pool.shape) == (len(attending), 2, blocks, BLOCK_SIZE, model_support.kv_heads(config),
                                        model_support.head_dim(config))
    assert runner.kv_slabs == {layer: slab for slab, layer in enumerate(attending)}
    assert len(runner.layer_caches) == 2 * len(attending)
    pool_bytes = runner.pool.numel() * runner.pool.element_size()
    assert runner.block_bytes == len(attending) * layer_bytes
    assert runner.handshake().num_layers == len(attending)
    assert _stated_bytes(runner) == (runner.block_bytes, pool_bytes)
    # every slab is one an attention layer writes: after a prefill into blocks 0-2 each holds K and V there
    runner.execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT, len(PROMPT), 0, len(PROMPT), [0, 1, 2],
                                                     SamplingSpec(temperature=0.0), state_slot=0)]))
    for slab in range(len(attending)):
        for kv in (0, 1):
            assert runner.pool[slab, kv, :3].abs().sum(dim=(1, 2, 3)).min() > 0, (slab, kv)
            assert not runner.pool[slab, kv, 3:].any(), (slab, kv)


def test_a_model_whose_every_layer_attends_keeps_a_slab_per_layer():
    runner, layer_bytes = _runner("Llama", blocks_of_every_layer=40)
    config = runner.model.config
    assert tuple(runner.pool.shape) == (config.num_hidden_layers, 2, 40, BLOCK_SIZE,
                                        config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
    assert runner.kv_slabs is None     # the identity: the step looks nothing up
    assert runner.handshake().num_layers == config.num_hidden_layers
    assert _stated_bytes(runner) == (config.num_hidden_layers * layer_bytes,
                                     runner.pool.numel() * runner.pool.element_size())


def test_a_model_without_attention_layers_has_a_pool_of_no_slab():
    runner, _ = _runner("Mamba (SSM on the state pool)", blocks_of_every_layer=40)
    # its blocks hold no bytes: as many as every state slot's sequence needs at full length, whatever the budget
    blocks = DEFAULT_NUM_SLOTS * -(-runner.max_model_len // BLOCK_SIZE)
    assert tuple(runner.pool.shape) == (0, 2, blocks, BLOCK_SIZE, 1, 1)
    assert runner.layer_caches == [] and runner.block_bytes == 0
    assert runner.handshake().num_layers == 0
    assert _stated_bytes(runner) == (0, 0)
    result = runner.execute(StepPlan(1, new_seqs=[NewSequence(1, PROMPT, len(PROMPT), 0, len(PROMPT), [0, 1, 2],
                                                              SamplingSpec(temperature=0.0), state_slot=0)]))
    assert len(result.sampled) == 1


def test_a_cpu_pool_is_zeros_and_asks_for_huge_pages_where_linux_has_them():
    import os
    pool = kv_pool.allocate_pool(1, 32, 16, 4, 64, torch.float32, torch.device("cpu"))   # 2 x 2 MiB
    assert pool.shape == (1, 2, 32, 16, 4, 64) and not bool(pool.any())
    # the advice is refused only where the kernel has no transparent huge pages at all
    has_thp = os.path.isdir("/sys/kernel/mm/transparent_hugepage")
    assert kv_pool.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8)) == has_thp
    assert not kv_pool.advise_huge_pages(torch.empty(16))   # no whole huge page inside it
