"""Several data-plane replicas behind one API: a router in front of one engine per replica.

Each replica is a whole engine (its own scheduler, block manager, data-plane client) driving its
own data plane with its own KV pool; the router only chooses, per request, which engine gets it:

  1. prefix affinity: the hashes of the prompt's leading full blocks (up to AFFINITY_BLOCKS, each
     chained on the one before, as the block manager's prefix cache hashes them) remember which
     replica last took a prompt starting that way; a request whose deepest known leading block
     maps to a replica goes there, where those blocks may still be cached,
  2. unless that replica is overloaded: its unfinished requests exceed the least-loaded live
     replica's by `slack` (a quarter of a batch), and
  3. otherwise, by load: the live replica with the fewest unfinished requests (ties: the one that
     was given fewer requests so far).

A replica whose data plane is gone hands its unfinished requests to the live replicas
(control_plane/failover.py); one that answers again takes new requests, and takes over the
requests of replicas still down when it was the only way to run them. A replica whose data plane
did not answer at start joins when it does. /health is "degraded" while some replicas are down.

To the API the router looks like one engine (the interface section of engine.py); /metrics exports
every engine's series with a `replica` label ("0", "1", ...), and the router's own: replicas up,
requests moved.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from control_plane import failover

from control_plane.block_manager import chain_block_hashes
from control_plane.engine import Engine
from control_plane.request import Request
from control_plane.sampling_params import SamplingParams

log = logging.getLogger("pagedserve.control_plane")
AFFINITY_BLOCKS = 4          # leading blocks that are hashed for affinity
MAX_AFFINITY_ENTRIES = 65536  # remembered prefixes; the oldest are forgotten first


def leading_block_hashes(prompt_ids: list[int], block_size: int, max_blocks: int = AFFINITY_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's leading full blocks: entry i covers tokens [0, (i+1)*block_size)."""
    num_blocks = min(len(prompt_ids) // block_size, max_blocks)
    return [h for _, h, _ in chain_block_hashes(prompt_ids, block_size, num_blocks)]


class Router:
    def __init__(self, engines: list[Engine]):
        assert engines, "a router needs at least one engine"
        first = engines[0]
        for i, e in enumerate(engines[1:], start=1):
            if (e.hs.vocab_size, e.hs.block_size) != (first.hs.vocab_size, first.hs.block_size):
                raise ValueError(f"replica {i} serves another model or block size than replica 0: "
                                 f"{e.hs.model_id} (block size {e.hs.block_size}) against {first.hs.model_id} "
                                 f"(block size {first.hs.block_size})")
        self.engines = engines
        self.config = first.config
        self.tokenizer = first.tokenizer
        self.slack = max(1, self.config.max_num_seqs // 4)
        self._affinity: OrderedDict[int, int] = OrderedDict()   # leading-block hash -> replica
        self.num_routed = [0] * len(engines)
        self.num_affinity_hits = 0
        self.num_moved = 0
        for e in engines:
            e.on_down = self._on_down
            e.on_up = self._on_up
        self.stats = _ReplicaStats(self)

    # --- what api.py reads of an engine -------------------------------------------------
    @property
    def hs(self):
        return self.engines[0].hs

    @property
    def pool_capacity_tokens(self) -> int:
        return min(e.pool_capacity_tokens for e in self.engines)

    @property
    def data_plane_alive(self) -> bool:
        return any(e.data_plane_alive for e in self.engines)

    @property
    def draining(self) -> bool:
        return self.engines[0].draining

    @draining.setter
    def draining(self, value: bool) -> None:
        for e in self.engines:
            e.draining = value

    def live_replicas(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e.data_plane_alive]

    def health(self) -> dict:
        """/health's body: every replica up is "ok"; some down, "degraded" (still served)."""
        up = self.live_replicas()
        down = [i for i in range(len(self.engines)) if i not in up]
        return {"status": "degraded" if down else "ok", "replicas": len(self.engines), "replicas_up": len(up),
                "replicas_down": down}

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        for e in self.engines:
            e.validate_request(prompt_ids, params)

    def num_unfinished(self) -> int:
        return sum(e.num_unfinished() for e in self.engines)

    def num_waiting(self) -> int:
        return sum(e.num_waiting() for e in self.engines)

    @property
    def kv_block_bytes(self) -> int:
        return self.engines[0].kv_block_bytes

    def refresh_gauges(self) -> None:
        for e in self.engines:
            e.refresh_gauges()

    def kv_report(self) -> dict:
        """Every replica's /debug/kv summed; the integrity check names the first replica that fails."""
        reports = [e.kv_report() for e in self.engines]
        total = {key: sum(r[key] for r in reports) for key in ("device_blocks", "device_blocks_used", "cpu_blocks",
                                                               "cpu_blocks_used", "state_slots", "state_slots_used",
                                                               "running", "waiting", "swapped")}
        total["preemptions"] = {kind: sum(r["preemptions"][kind] for r in reports) for kind in ("recompute", "swap")}
        bad = [f"replica {i}: {r['integrity'].removeprefix('violated: ')}" for i, r in enumerate(reports)
               if r["integrity"] != "ok"]
        total["integrity"] = f"violated: {bad[0]}" if bad else "ok"
        return total

    # --- routing ----------------------------------------------------------------------------
    def choose(self, prompt_ids: list[int]) -> int:
        live = [i for i, e in enumerate(self.engines) if e.data_plane_alive] or list(range(len(self.engines)))
        load = {i: self.engines[i].num_unfinished() for i in live}
        least = min(live, key=lambda i: (load[i], self.num_routed[i], i))
        hashes = leading_block_hashes(prompt_ids, self.hs.block_size)
        chosen = least
        for h in reversed(hashes):            # the deepest prefix seen before wins
            replica = self._affinity.get(h)
            if replica is not None:
                if replica in load and load[replica] < load[least] + self.slack:
                    chosen = replica
                    self.num_affinity_hits += 1
                break
        for h in hashes:
            self._affinity[h] = chosen
            self._affinity.move_to_end(h)
        while len(self._affinity) > MAX_AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        self.num_routed[chosen] += 1
        return chosen

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    timeout: float | None = None) -> Request:
        self.validate_request(prompt_ids, params)
        return self.admit(request_id, prompt_ids, params, timeout)

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
              timeout: float | None = None) -> Request:
        """A validated request (validate_request checked it on every replica) to the chosen replica."""
        replica = self.choose(prompt_ids)
        req = self.engines[replica].admit(request_id, prompt_ids, params, timeout)
        req.replica = replica
        return req

    def abort(self, req: Request, reason: str = "abort", error: str | None = None) -> None:
        self.engines[req.replica].abort(req, reason, error)

    # --- replicas lost and back -----------------------------------------------------------------
    def _on_down(self, engine: Engine) -> None:
        replica = self.engines.index(engine)
        live = self.live_replicas()
        if not live:
            log.error("replica %d is down, and no other replica is up: its %d requests wait for one",
                      replica, engine.num_unfinished())
            return
        requests = failover.detach(engine)
        log.warning("replica %d is down; %d requests move to replica%s %s", replica, len(requests),
                    "s" if len(live) > 1 else "", ", ".join(map(str, live)))
        self.num_moved += failover.move(requests, self.engines, live)

    def _on_up(self, engine: Engine) -> None:
        replica = self.engines.index(engine)
        log.info("replica %d is up (%d of %d)", replica, len(self.live_replicas()), len(self.engines))
        for i, other in enumerate(self.engines):
            if not other.data_plane_alive and other.num_unfinished():
                requests = failover.detach(other)
                log.warning("replica %d is still down; its %d requests move to replica %d", i, len(requests),
                            replica)
                self.num_moved += failover.move(requests, self.engines, [replica])

    # --- lifetime -----------------------------------------------------------------------------
    async def run(self) -> None:
        await asyncio.gather(*(e.run() for e in self.engines))

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()


class _ReplicaStats:
    """/metrics of all replicas: each engine's own series, with a `replica` label added, and the
    router's own series."""

    def __init__(self, router: Router):
        self.router = router
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        router = self.router
        name = [router.config.model_name]
        up = GaugeMetricFamily("pagedserve_replicas_up", "Replicas whose data plane answers", labels=["model_name"])
        up.add_metric(name, len(router.live_replicas()))
        yield up
        total = GaugeMetricFamily("pagedserve_replicas", "Replicas this control plane serves with",
                                  labels=["model_name"])
        total.add_metric(name, len(router.engines))
        yield total
        moved = CounterMetricFamily("pagedserve_requests_moved", "Requests moved to another replica, where they "
                                    "were recomputed, because theirs was down", labels=["model_name"])
        moved.add_metric(name, router.num_moved)
        yield moved
        yield from self._per_replica()

    def _per_replica(self):
        families: dict[str, Metric] = {}
        for replica, e in enumerate(self.router.engines):
            for metric in e.stats.registry.collect():
                merged = families.get(metric.name)
                if merged is None:
                    merged = families[metric.name] = Metric(metric.name, metric.documentation, metric.type,
                                                            metric.unit)
                for s in metric.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": str(replica)}, s.value, s.timestamp,
                                      s.exemplar)
        return list(families.values())
