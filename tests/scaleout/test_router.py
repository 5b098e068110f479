"""The router's choices, on stand-in engines: load, prefix affinity, dead replicas, metric labels."""
from types import SimpleNamespace

from prometheus_client import generate_latest

from control_plane.metrics import EngineStats
from control_plane.router import Router, leading_block_hashes

BLOCK = 16


class FakeEngine:
    def __init__(self):
        self.hs = SimpleNamespace(vocab_size=1000, block_size=BLOCK, model_id="m")
        self.config = SimpleNamespace(max_num_seqs=8, model_name="m")
        self.tokenizer = self.policy = None
        self.data_plane_alive = True
        self.requests = []
        self.stats = EngineStats("m")

    def num_unfinished(self):
        return len(self.requests)

    def admit(self, request_id, prompt_ids, params, timeout=None):
        req = SimpleNamespace(request_id=request_id)
        self.requests.append(req)
        return req


def prompt(first_token, length=40):
    return [first_token] + [7] * (length - 1)


def test_chained_hashes_cover_whole_leading_blocks_only():
    a = leading_block_hashes(list(range(40)), BLOCK)
    assert len(a) == 2                                       # 40 tokens: 2 full blocks
    b = leading_block_hashes(list(range(32)) + [99] * 8, BLOCK)
    assert a == b                                            # the partial block is not hashed
    c = leading_block_hashes([5] + list(range(1, 40)), BLOCK)
    assert c[0] != a[0] and c[1] != a[1]                     # the second hash is chained on the first


def test_distinct_prompts_spread_over_the_replicas_by_load():
    engines = [FakeEngine(), FakeEngine()]
    router = Router(engines)
    for i in range(6):
        router.admit(f"r{i}", prompt(100 + i), None)
    assert [len(e.requests) for e in engines] == [3, 3]
    engines[0].requests.clear()                              # replica 0 finished its work
    replicas = [router.admit(f"s{i}", prompt(200 + i), None).replica for i in range(3)]
    assert replicas == [0, 0, 0]


def test_shared_prefix_goes_to_the_same_replica_until_it_is_overloaded():
    engines = [FakeEngine(), FakeEngine()]
    router = Router(engines)                                 # slack: max_num_seqs // 4 = 2
    shared = list(range(500, 532))                           # two full blocks in common
    first = router.admit("a", shared + [1, 2, 3], None).replica
    other = router.admit("b", prompt(900), None).replica
    assert other != first
    followers = [router.admit(f"c{i}", shared + [10 + i] * 5, None).replica for i in range(2)]
    assert followers == [first, first] and router.num_affinity_hits == 2
    # now `first` holds 3 requests against 1: one more over the slack, the next one goes elsewhere
    assert router.admit("d", shared + [77], None).replica == other


def test_dead_replicas_get_no_requests():
    engines = [FakeEngine(), FakeEngine()]
    engines[1].data_plane_alive = False
    router = Router(engines)
    assert {router.admit(f"r{i}", prompt(i), None).replica for i in range(4)} == {0}
    assert router.data_plane_alive


def test_metrics_carry_a_replica_label():
    engines = [FakeEngine(), FakeEngine()]
    engines[0].stats.on_arrival(5)
    engines[1].stats.on_arrival(7)
    engines[1].stats.on_arrival(3)
    text = generate_latest(Router(engines).stats.registry).decode()
    assert 'pagedserve_prompt_tokens_total{model_name="m",replica="0"} 5.0' in text
    assert 'pagedserve_prompt_tokens_total{model_name="m",replica="1"} 10.0' in text
    assert text.count("# TYPE pagedserve_prompt_tokens_total counter") == 1
