"""A discrete-event simulator of GPU jobs reading datasets through a distributed cache.

Between two events every rate is constant, so the simulator jumps from event to event:
arrivals, policy wake-ups and preload starts (external, on a heap), and job completions, epoch
ends, ends of restart pauses and preload completions (computed from the current state).

A job's speed is the slower of its compute rate (the ground truth in :mod:`.truth`) and its
data rate. Each node of a job reads a share of every epoch proportional to its GPUs; a sample
is local (cached on that node in the job's copy), peer (cached on another node of the copy) or a
miss (read from the object store, then admitted to its owner in the copy if there is room —
"avoid eviction"; a full owner reads through). The hit/miss mix is fixed at the start of each
epoch from what the copy holds then. Shared bandwidth is split evenly among its readers:
the store's total among all store readers (capped per node by the node's store link, itself
split among that node's readers), a copy's peer bandwidth (holders x per-node) among its peer
readers, a node's local bandwidth among its local readers.

With ``ClusterConfig.nic_bytes_per_s`` set, peer and store reads cross real links instead: every
node has a link of that many bytes/s each way. A job's node reading peer shards is one inbound
flow on its link and one outbound flow on each holder's link, reading each holder's shards in
proportion to the bytes it holds; a store reader is one inbound flow. A multi-node job's
gradient exchange (ring all-reduce: 2(n-1)/n of the model's ``sync_bytes`` per step each way,
at the job's compute rate) is one more flow on each of its nodes' links: max-min fair, it takes
what it needs up to an equal share, and the data flows split the rest evenly.

Every decision a policy makes is checked (GPUs exist and are free, jobs are in the right state);
a broken rule stops the run with a :class:`SimulationError` naming the policy and the decision.
Nothing here reads a clock: time is the simulated time.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from coordinator.scheduling.model import (
    Clone,
    ClusterState,
    Dataset,
    Decision,
    JobSpec,
    JobState,
    Node,
    Resize,
    Start,
    Wait,
)
from coordinator.scheduling.perf import local_batch
from coordinator.scheduling.policy import Policy
from coordinator.scheduling.tdcs import copy_of
from coordinator.scheduling.themis import independent_seconds

from .cluster import ClusterConfig, DatasetSpec, Preload, SimulationError, Trace
from .metrics import JobRecord, SimResult
from .truth import CATALOGUE, TrueModel

_EPS = 1e-9
#: shortest constant-rate stretch a job reports as an epoch-time measurement.
MIN_OBSERVED_S = 60.0
_DONE = 1e-6  # fraction of a job's samples below which it counts as finished


@dataclass
class _Copy:
    """One cached copy of a dataset: its nodes and the bytes each holds."""

    nodes: set[str]
    cached: dict[str, float] = field(default_factory=dict)

    def total(self) -> float:
        return sum(self.cached.values())


@dataclass
class _Data:
    spec: DatasetSpec
    copies: list[_Copy] = field(default_factory=list)
    last_used: float = 0.0


@dataclass
class _Job:
    spec: JobSpec
    truth: TrueModel
    placement: dict[str, int] = field(default_factory=dict)
    samples_done: float = 0.0
    attained_gpu_s: float = 0.0
    observations: list[tuple[int, float]] = field(default_factory=list)
    arrived: bool = False
    first_start: float | None = None
    finish: float | None = None
    resume_at: float = 0.0
    copy: int | None = None
    #: node -> (local, peer, miss) fractions of reads during the current epoch.
    mix: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    rate: float = 0.0
    #: samples done when the current epoch ends (the job's end for jobs without a dataset:
    #: only a dataset's hit/miss mix changes at epoch ends).
    epoch_end: float = 0.0
    #: the current constant-rate stretch: when it began, its rate and GPUs (P2's measurements).
    segment_start: float = 0.0
    segment_rate: float = 0.0
    segment_gpus: int = 0
    store_bytes: float = 0.0
    peer_bytes: float = 0.0
    local_bytes: float = 0.0
    restarts: int = 0
    #: the simulator's running integral of apps present, at arrival and at finish (for ρ).
    apps_integral_at_arrival: float = 0.0
    apps_integral_at_finish: float = 0.0

    @property
    def running(self) -> bool:
        return bool(self.placement)

    def active(self, now: float) -> bool:
        return self.running and now + _EPS >= self.resume_at

    @property
    def gpus(self) -> int:
        return sum(self.placement.values())

    @property
    def tolerance(self) -> float:
        """Samples within which a boundary counts as reached (float error of rate x time)."""
        return self.spec.samples_per_epoch * _DONE


@dataclass
class _LinkShares:
    """Bytes/s one data flow gets of each node's link: inbound (reads arriving) and outbound
    (peer reads the node serves)."""

    inbound: dict[str, float]
    outbound: dict[str, float]


@dataclass
class _PreloadRun:
    spec: Preload
    copy: int
    #: node -> bytes per second while running (recomputed at every event).
    rates: dict[str, float] = field(default_factory=dict)
    done: bool = False


class Simulator:
    """Runs one trace under one policy on one cluster."""

    def __init__(
        self,
        cluster: ClusterConfig,
        trace: Trace,
        policy: Policy,
        *,
        truth: Mapping[str, TrueModel] = CATALOGUE,
        max_events: int = 2_000_000,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.io = cluster.io
        self.max_events = max_events
        self.rng = random.Random(cluster.seed)
        self.total_gpus = sum(node.gpus for node in cluster.nodes)
        self.per_node = max(node.gpus for node in cluster.nodes)
        self.free = {node.name: node.gpus for node in cluster.nodes}
        self.capacity = {node.name: float(node.cache_bytes) for node in cluster.nodes}
        self.data = {name: _Data(spec) for name, spec in trace.datasets.items()}
        self.jobs = {spec.job_id: self._new_job(spec, truth) for spec in trace.jobs}
        #: arrived, unfinished jobs in arrival order (the loops below only look at these).
        self.live: dict[str, _Job] = {}
        self.unfinished = len(self.jobs)
        self.preloads: list[_PreloadRun] = []
        self.now = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self._wakeups: set[float] = set()
        # accounting
        self.allocated_gpu_s = 0.0
        self.active_apps_integral = 0.0
        self.preload_store_bytes = 0.0
        self.events_processed = 0
        self._start_copies()
        for spec in trace.jobs:
            self._push(spec.arrival, "arrive", spec.job_id)
        for preload in trace.preloads:
            if preload.dataset not in self.data:
                raise SimulationError(f"preload of unknown dataset {preload.dataset!r}")
            self._push(preload.at, "preload", preload)

    # --- setup ------------------------------------------------------------------------------------

    def _new_job(self, spec: JobSpec, truth: Mapping[str, TrueModel]) -> _Job:
        if spec.profile.name not in truth:
            raise SimulationError(
                f"job {spec.job_id!r}: no ground truth for model {spec.profile.name!r}"
            )
        if spec.dataset is not None and spec.dataset not in self.data:
            raise SimulationError(
                f"job {spec.job_id!r}: dataset {spec.dataset!r} is not in the trace"
            )
        if spec.gpus > self.total_gpus:
            raise SimulationError(
                f"job {spec.job_id!r} asks {spec.gpus} GPUs; the cluster has {self.total_gpus}"
            )
        return _Job(spec, truth[spec.profile.name])

    def _start_copies(self) -> None:
        if self.cluster.cache_mode != "static":
            return
        every_node = {node.name for node in self.cluster.nodes}
        for name, data in self.data.items():
            copies = self.cluster.static_copies.get(name) or (frozenset(every_node),)
            data.copies = [_Copy(set(nodes)) for nodes in copies]

    def _push(self, time: float, kind: str, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time, self._seq, kind, payload))

    # --- the main loop ----------------------------------------------------------------------------

    def run(self) -> SimResult:
        self._recompute_rates()
        while self.unfinished:
            self.events_processed += 1
            if self.events_processed > self.max_events:
                raise SimulationError(
                    f"policy {self.policy.name}: more than {self.max_events} events; "
                    "it keeps changing its mind without progress"
                )
            next_time = min(self._next_internal(), self._events[0][0] if self._events else math.inf)
            if next_time == math.inf:
                stuck = list(self.live)
                raise SimulationError(
                    f"policy {self.policy.name} left jobs {stuck[:5]} waiting with nothing running"
                    " and nothing scheduled: they would never finish"
                )
            self._advance(max(next_time, self.now))
            if self._handle_due():
                self._schedule()
            self._recompute_rates()
        return self._result()

    def _handle_due(self) -> bool:
        """Process everything due now; True when the policy must be asked."""
        ask = False
        for job in list(self.live.values()):
            if not job.running:
                continue
            if job.samples_done >= job.spec.samples - job.tolerance:
                self._finish(job)
                ask = True
            elif job.samples_done >= job.epoch_end - job.tolerance:
                self._end_epoch(job)
        for run in self.preloads:
            if not run.done and not self._preload_wants(run):
                run.done = True
        while self._events and self._events[0][0] <= self.now:
            time, _seq, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                job = self.jobs[payload]  # type: ignore[index]
                job.arrived = True
                self.live[job.spec.job_id] = job
                job.apps_integral_at_arrival = self.active_apps_integral
                ask = True
            elif kind == "preload":
                self._start_preload(payload)  # type: ignore[arg-type]
            elif kind == "wakeup":
                self._wakeups.discard(time)
                ask = True
        return ask

    def _next_internal(self) -> float:
        """The earliest job completion, epoch end or preload completion at current rates."""
        soonest = math.inf
        for job in self.live.values():
            if not job.running:
                continue
            if job.resume_at > self.now + _EPS:
                soonest = min(soonest, job.resume_at)
            elif job.rate > 0:
                soonest = min(soonest, self.now + (job.epoch_end - job.samples_done) / job.rate)
        for run in self.preloads:
            if run.done:
                continue
            for node, rate in run.rates.items():
                if rate > 0:
                    soonest = min(soonest, self.now + self._preload_missing(run, node) / rate)
        return soonest

    # --- time passing -----------------------------------------------------------------------------

    def _advance(self, until: float) -> None:
        dt = until - self.now
        if dt <= 0:
            self.now = max(self.now, until)
            return
        self.active_apps_integral += len(self.live) * dt
        for job in self.live.values():
            if not job.running:
                continue
            self.allocated_gpu_s += job.gpus * dt
            job.attained_gpu_s += job.gpus * dt
            if job.rate <= 0 or job.resume_at > self.now + _EPS:
                continue
            samples = min(job.rate * dt, job.spec.samples - job.samples_done)
            job.samples_done += samples
            self._read(job, samples)
        for run in self.preloads:
            if not run.done:
                self._preload_progress(run, dt)
        self.now = until

    def _read(self, job: _Job, samples: float) -> None:
        """Account the bytes behind ``samples`` and admit the misses to the job's copy."""
        data = self.data.get(job.spec.dataset or "")
        if data is None:
            return
        data.last_used = self.now
        sample_bytes = data.spec.sample_bytes
        missed = 0.0
        for node, gpus in job.placement.items():
            local, peer, miss = job.mix[node]
            share = samples * sample_bytes * gpus / job.gpus
            job.local_bytes += share * local
            job.peer_bytes += share * peer
            job.store_bytes += share * miss
            missed += share * miss
        if job.copy is not None and missed > 0:
            self._admit(data, data.copies[job.copy], missed)

    def _admit(self, data: _Data, copy: _Copy, amount: float) -> None:
        """Cache ``amount`` bytes spread evenly over the copy's owners, where there is room."""
        owners = sorted(copy.nodes)
        target = data.spec.size / len(owners)
        for node in owners:
            held = copy.cached.get(node, 0.0)
            if held >= target:
                continue  # this owner's share is all cached already
            room = min(target - held, self._room(node, data))
            if room > 0:
                copy.cached[node] = held + min(amount / len(owners), room)

    def _room(self, node: str, reader: _Data) -> float:
        """Free cache bytes on ``node``, after LRU cleanup of datasets nobody is reading."""
        free = self.capacity[node] - self._used(node)
        if free > 0:
            return free
        busy = {job.spec.dataset for job in self.live.values() if job.running}
        busy |= {run.spec.dataset for run in self.preloads if not run.done}
        idle = [d for d in self.data.values() if d is not reader and d.spec.name not in busy]
        for data in sorted(idle, key=lambda d: d.last_used):
            for copy in data.copies:
                copy.cached.pop(node, None)
            free = self.capacity[node] - self._used(node)
            if free > 0:
                break
        return max(free, 0.0)

    def _used(self, node: str) -> float:
        return sum(copy.cached.get(node, 0.0) for d in self.data.values() for copy in d.copies)

    # --- epochs, completion -----------------------------------------------------------------------

    def _end_epoch(self, job: _Job) -> None:
        """A new epoch: refresh the hit/miss mix from what the copy holds now."""
        job.samples_done = job.epoch_end
        job.epoch_end = min(job.spec.samples, job.epoch_end + job.spec.samples_per_epoch)
        self._refresh_mix(job)

    def _observe(self, job: _Job, new_rate: float) -> None:
        """End the job's constant-rate stretch if its rate changes; a stretch of at least
        ``MIN_OBSERVED_S`` is reported as a measured epoch time (with noise), as P2's jobs do."""
        if abs(new_rate - job.segment_rate) <= 1e-9 * max(new_rate, 1.0):
            return
        if job.segment_rate > 0 and self.now - job.segment_start >= MIN_OBSERVED_S:
            noise = 1.0 + self.rng.gauss(0.0, self.cluster.observation_noise)
            epoch_s = job.spec.samples_per_epoch / job.segment_rate * noise
            job.observations.append((job.segment_gpus, epoch_s))
            del job.observations[:-50]
        job.segment_start, job.segment_rate, job.segment_gpus = self.now, new_rate, job.gpus

    def _finish(self, job: _Job) -> None:
        job.samples_done = job.spec.samples
        job.finish = self.now
        for node, gpus in job.placement.items():
            self.free[node] += gpus
        job.placement = {}
        self._observe(job, 0.0)
        job.rate = 0.0
        job.apps_integral_at_finish = self.active_apps_integral
        del self.live[job.spec.job_id]
        self.unfinished -= 1

    def _refresh_mix(self, job: _Job) -> None:
        data = self.data.get(job.spec.dataset or "")
        if data is None:
            job.mix = {node: (0.0, 0.0, 0.0) for node in job.placement}
            return
        size = float(data.spec.size)
        copy = data.copies[job.copy] if job.copy is not None else None
        total = min(copy.total(), size) if copy else 0.0
        job.mix = {}
        for node in job.placement:
            local = min(copy.cached.get(node, 0.0), total) if copy else 0.0
            job.mix[node] = (local / size, (total - local) / size, 1.0 - total / size)

    # --- rates ------------------------------------------------------------------------------------

    def _recompute_rates(self) -> None:
        io = self.io
        readers = [
            (job, node)
            for job in self.live.values()
            if job.active(self.now) and job.spec.dataset is not None
            for node in job.placement
        ]
        preload_nodes = [
            (run, node)
            for run in self.preloads
            if not run.done
            for node in self.data[run.spec.dataset].copies[run.copy].nodes
            if self._preload_missing(run, node) > 1.0
        ]
        store_per_node: dict[str, int] = {}
        local_per_node: dict[str, int] = {}
        peer_per_copy: dict[tuple[str, int], int] = {}
        store_total = 0
        for job, node in readers:
            local, peer, miss = job.mix[node]
            if miss > 0:
                store_per_node[node] = store_per_node.get(node, 0) + 1
                store_total += 1
            if local > 0:
                local_per_node[node] = local_per_node.get(node, 0) + 1
            if peer > 0 and job.copy is not None:
                key = (job.spec.dataset or "", job.copy)
                peer_per_copy[key] = peer_per_copy.get(key, 0) + 1
        for _run, node in preload_nodes:
            store_per_node[node] = store_per_node.get(node, 0) + 1
            store_total += 1

        links = self._link_shares(readers, preload_nodes) if self.cluster.nic_bytes_per_s else None

        def store_share(node: str) -> float:
            share = min(io.store_per_node / store_per_node[node], io.store_total / store_total)
            return min(share, links.inbound[node]) if links else share

        for run in self.preloads:
            run.rates = {node: store_share(node) for r, node in preload_nodes if r is run}

        for job in self.live.values():
            if not job.running and job.segment_rate == 0.0:
                continue  # waiting, and its last stretch is already closed
            rate = 0.0
            if job.active(self.now):
                compute = job.truth.rate(job.spec, job.placement)
                rate = min(
                    compute,
                    self._data_rate(job, store_share, local_per_node, peer_per_copy, links),
                )
            self._observe(job, rate)
            job.rate = rate

    def _data_rate(
        self,
        job: _Job,
        store_share: Callable[[str], float],
        local_per_node: Mapping[str, int],
        peer_per_copy: Mapping[tuple[str, int], int],
        links: _LinkShares | None = None,
    ) -> float:
        """Samples/s the job's slowest node can read at its current mix and bandwidth shares."""
        data = self.data.get(job.spec.dataset or "")
        if data is None:
            return math.inf
        io = self.io
        holders = 0
        peer_readers = 1
        if job.copy is not None:
            copy = data.copies[job.copy]
            holders = sum(1 for held in copy.cached.values() if held > 0)
            peer_readers = peer_per_copy.get((data.spec.name, job.copy), 1)
        peer_bw = min(io.peer_per_node, holders * io.peer_per_node / peer_readers)
        rate = math.inf
        for node, gpus in job.placement.items():
            local, peer, miss = job.mix[node]
            node_peer_bw = peer_bw
            if links is not None and peer > 0:
                node_peer_bw = self._peer_flow_rate(job, node, links)
            seconds_per_sample = data.spec.sample_bytes * (
                (local / (io.local_per_node / local_per_node[node]) if local > 0 else 0.0)
                + (peer / node_peer_bw if peer > 0 else 0.0)
                + (miss / store_share(node) if miss > 0 else 0.0)
            )
            if seconds_per_sample > 0:
                rate = min(rate, job.gpus / gpus / seconds_per_sample)
        return rate

    # --- network links (ClusterConfig.nic_bytes_per_s) -------------------------------------------

    def _peer_holders(self, job: _Job, node: str) -> dict[str, float]:
        """The other nodes holding bytes of the job's copy: node -> bytes held."""
        if job.copy is None:
            return {}
        copy = self.data[job.spec.dataset or ""].copies[job.copy]
        return {holder: held for holder, held in copy.cached.items() if held > 0 and holder != node}

    def _gradient_traffic(self) -> dict[str, float]:
        """Bytes/s each way that multi-node jobs' ring all-reduce puts on each of their nodes."""
        traffic: dict[str, float] = {}
        for job in self.live.values():
            nodes = len(job.placement)
            if nodes < 2 or not job.active(self.now) or not job.spec.profile.sync_bytes:
                continue
            steps_per_s = job.truth.rate(job.spec, job.placement) / (
                local_batch(job.spec, job.gpus) * job.gpus
            )
            per_node = 2 * (nodes - 1) / nodes * job.spec.profile.sync_bytes * steps_per_s
            for node in job.placement:
                traffic[node] = traffic.get(node, 0.0) + per_node
        return traffic

    def _link_shares(
        self, readers: list[tuple[_Job, str]], preload_nodes: list[tuple[_PreloadRun, str]]
    ) -> _LinkShares:
        """What one data flow gets of each node's inbound and outbound link."""
        nic = float(self.cluster.nic_bytes_per_s or 0.0)
        inbound_flows: dict[str, int] = {}
        outbound_flows: dict[str, int] = {}
        for job, node in readers:
            _local, peer, miss = job.mix[node]
            if miss > 0:
                inbound_flows[node] = inbound_flows.get(node, 0) + 1
            holders = self._peer_holders(job, node) if peer > 0 else {}
            if holders:
                inbound_flows[node] = inbound_flows.get(node, 0) + 1
                for holder in holders:
                    outbound_flows[holder] = outbound_flows.get(holder, 0) + 1
        for _run, node in preload_nodes:
            inbound_flows[node] = inbound_flows.get(node, 0) + 1
        gradient = self._gradient_traffic()

        def per_flow(flows: dict[str, int]) -> dict[str, float]:
            shares = {}
            for node, count in flows.items():
                # Max-min fair: the gradient exchange is one flow wanting ``gradient[node]``.
                taken = min(gradient.get(node, 0.0), nic / (count + 1))
                shares[node] = (nic - taken) / count
            return shares

        inbound = {node: nic for node in self.capacity} | per_flow(inbound_flows)
        outbound = {node: nic for node in self.capacity} | per_flow(outbound_flows)
        return _LinkShares(inbound, outbound)

    def _peer_flow_rate(self, job: _Job, node: str, links: _LinkShares) -> float:
        """Bytes/s of ``node``'s peer reads: its inbound share, and each holder's outbound share
        over the fraction of the peer bytes that holder serves."""
        holders = self._peer_holders(job, node)
        held = sum(holders.values())
        if held <= 0:
            return math.inf
        rate = links.inbound[node]
        for holder, amount in holders.items():
            rate = min(rate, links.outbound[holder] * held / amount)
        return rate

    # --- preloads ---------------------------------------------------------------------------------

    def _start_preload(self, spec: Preload) -> None:
        data = self.data[spec.dataset]
        if self.cluster.cache_mode == "none":
            return
        if spec.nodes is None:
            if not data.copies:
                raise SimulationError(
                    f"preload of {spec.dataset!r} names no nodes and the dataset has no copy yet"
                )
            index = 0
        else:
            matching = [i for i, copy in enumerate(data.copies) if copy.nodes == set(spec.nodes)]
            if matching:
                index = matching[0]
            else:
                data.copies.append(_Copy(set(spec.nodes)))
                index = len(data.copies) - 1
        self.preloads.append(_PreloadRun(spec, index))

    def _preload_missing(self, run: _PreloadRun, node: str) -> float:
        """Bytes ``node`` still lacks for the preload: its share of the fraction, as far as its
        free cache allows."""
        data = self.data[run.spec.dataset]
        copy = data.copies[run.copy]
        held = copy.cached.get(node, 0.0)
        want = run.spec.fraction * data.spec.size / len(copy.nodes)
        return max(0.0, min(want - held, self.capacity[node] - self._used(node)))

    def _preload_wants(self, run: _PreloadRun) -> bool:
        copy = self.data[run.spec.dataset].copies[run.copy]
        return any(self._preload_missing(run, node) > 1.0 for node in copy.nodes)

    def _preload_progress(self, run: _PreloadRun, dt: float) -> None:
        data = self.data[run.spec.dataset]
        copy = data.copies[run.copy]
        for node, rate in run.rates.items():
            held = copy.cached.get(node, 0.0)
            loaded = min(rate * dt, self._preload_missing(run, node))
            copy.cached[node] = held + loaded
            self.preload_store_bytes += loaded

    # --- the policy -------------------------------------------------------------------------------

    def state(self) -> ClusterState:
        nodes = {
            spec.name: Node(
                spec.name,
                spec.gpus,
                self.free[spec.name],
                spec.peak_flops,
                spec.memory_bandwidth,
                spec.network_bits_per_s,
                spec.overhead_s,
                spec.cache_bytes,
                int(self._used(spec.name)),
            )
            for spec in self.cluster.nodes
        }
        datasets = {}
        for name, data in self.data.items():
            cached: dict[str, int] = {}
            for copy in data.copies:
                for node, held in copy.cached.items():
                    cached[node] = cached.get(node, 0) + int(held)
            copies = tuple(frozenset(copy.nodes) for copy in data.copies)
            datasets[name] = Dataset(name, data.spec.size, cached, copies)
        running, waiting = [], []
        for job in sorted(self.live.values(), key=lambda j: (j.spec.arrival, j.spec.job_id)):
            view = JobState(
                job.spec,
                dict(job.placement),
                job.samples_done,
                job.attained_gpu_s,
                tuple(job.observations),
                job.first_start,
            )
            (running if job.running else waiting).append(view)
        return ClusterState(self.now, nodes, datasets, tuple(running), tuple(waiting), self.io)

    def _schedule(self) -> None:
        self._apply(self.policy.schedule(self.state()))
        if type(self.policy).next_wakeup is Policy.next_wakeup:
            return  # the policy never asks to be woken: skip building another state
        wake = self.policy.next_wakeup(self.state())
        if wake is not None and wake > self.now + _EPS and wake not in self._wakeups:
            self._wakeups.add(wake)
            self._push(wake, "wakeup", None)

    def _apply(self, decisions: list[Decision]) -> None:
        """Apply one batch: every Resize releases its GPUs first, then placements are made in
        order (so a batch may move jobs into GPUs another job of the batch gives up)."""
        for decision in decisions:
            if isinstance(decision, Resize):
                job = self._job_for(decision, decision.job_id)
                if not job.running:
                    self._reject(decision, "the job is not running")
                for node, gpus in job.placement.items():
                    self.free[node] += gpus
                job.placement = {}
                job.rate = 0.0
        for decision in decisions:
            if isinstance(decision, Wait):
                self._job_for(decision, decision.job_id)
            elif isinstance(decision, Clone):
                self._clone(decision)
            elif isinstance(decision, Start):
                job = self._job_for(decision, decision.job_id)
                if job.running or not job.arrived:
                    self._reject(decision, "the job is not waiting")
                self._occupy(decision, job, decision.placement)
            elif isinstance(decision, Resize):
                if decision.placement:
                    self._occupy(decision, self.jobs[decision.job_id], decision.placement)
            else:
                self._reject(decision, "unknown decision type")

    def _job_for(self, decision: Decision, job_id: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None or job.finish is not None:
            self._reject(decision, f"job {job_id!r} is unknown or finished")
        return job  # type: ignore[return-value]

    def _reject(self, decision: Decision, why: str) -> None:
        raise SimulationError(f"policy {self.policy.name} at t={self.now:.1f}s: {decision}: {why}")

    def _occupy(self, decision: Decision, job: _Job, placement: Mapping[str, int]) -> None:
        """Give ``placement`` to ``job`` after checking it; the job pauses to (re)start."""
        for node, gpus in placement.items():
            if gpus <= 0 or node not in self.free or self.free[node] < gpus:
                self._reject(decision, f"{gpus} GPUs on {node!r} are not free")
            if job.spec.candidates is not None and node not in job.spec.candidates:
                self._reject(decision, f"node {node!r} is not a candidate of the job")
        for node, gpus in placement.items():
            self.free[node] -= gpus
        restarting = job.first_start is not None
        job.placement = dict(placement)
        job.first_start = self.now if job.first_start is None else job.first_start
        job.restarts += restarting
        if not restarting:
            has_data = job.spec.dataset is not None
            job.epoch_end = (
                min(job.spec.samples, float(job.spec.samples_per_epoch))
                if has_data
                else job.spec.samples
            )
        pause = self.cluster.restart_s if restarting else job.truth.startup_s
        job.resume_at = self.now + pause
        self._attach_copy(job)
        self._refresh_mix(job)

    def _attach_copy(self, job: _Job) -> None:
        """The copy the job reads; under ``follow`` the copy grows to the job's nodes."""
        data = self.data.get(job.spec.dataset or "")
        if data is None or self.cluster.cache_mode == "none":
            job.copy = None
            return
        if not data.copies:
            data.copies.append(_Copy(set(job.placement)))
        index = copy_of(job.placement, [frozenset(c.nodes) for c in data.copies])
        job.copy = 0 if index is None else index
        if self.cluster.cache_mode == "follow":
            self._scale_copy(data, data.copies[job.copy], set(job.placement))

    def _scale_copy(self, data: _Data, copy: _Copy, job_nodes: set[str]) -> None:
        """P1's CacheScaler: the copy follows the job's nodes (event trigger) and grows further
        while its nodes cannot hold the dataset (monitoring trigger), emptiest caches first.

        Shards are owned by rendezvous hashing over the copy's nodes, so when it grows from K to
        K' nodes each old node keeps the K/K' of its shards it still owns; the cached bytes of the
        shards that moved are dropped (the new owners fetch them on a miss).
        """
        before = len(copy.nodes)
        copy.nodes |= job_nodes

        def room_for_copy(node: str) -> float:
            # What the node can give this copy: its capacity less what other data holds there.
            return self.capacity[node] - self._used(node) + copy.cached.get(node, 0.0)

        others = sorted(
            (node for node in self.capacity if node not in copy.nodes),
            key=lambda n: (-room_for_copy(n), n),
        )
        for node in others:
            if sum(room_for_copy(n) for n in copy.nodes) >= data.spec.size:
                break
            copy.nodes.add(node)
        if len(copy.nodes) > before:
            kept = before / len(copy.nodes)
            copy.cached = {node: held * kept for node, held in copy.cached.items()}

    def _clone(self, decision: Clone) -> None:
        data = self.data.get(decision.dataset)
        if data is None or not decision.nodes:
            self._reject(decision, "clone of an unknown dataset or onto no nodes")
        unknown = set(decision.nodes) - set(self.free)
        if unknown:
            self._reject(decision, f"unknown nodes {sorted(unknown)}")
        if self.cluster.cache_mode != "none":
            data.copies.append(_Copy(set(decision.nodes)))  # type: ignore[union-attr]

    # --- results ----------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        records = []
        for job in sorted(self.jobs.values(), key=lambda j: (j.spec.arrival, j.spec.job_id)):
            assert job.finish is not None and job.first_start is not None
            records.append(
                JobRecord(
                    spec=job.spec,
                    first_start=job.first_start,
                    finish=job.finish,
                    independent_s=self._independent_seconds(job),
                    store_bytes=job.store_bytes,
                    peer_bytes=job.peer_bytes,
                    local_bytes=job.local_bytes,
                    restarts=job.restarts,
                )
            )
        return SimResult(
            policy=self.policy.name,
            total_gpus=self.total_gpus,
            jobs=tuple(records),
            allocated_gpu_s=self.allocated_gpu_s,
            preload_store_bytes=self.preload_store_bytes,
            events=self.events_processed,
        )

    def _independent_seconds(self, job: _Job) -> float:
        """T_independent for ρ: the job alone on 1/N of the cluster, N = apps present on
        average during its life, at its true speed."""
        assert job.finish is not None
        life = job.finish - job.spec.arrival
        apps = job.apps_integral_at_finish - job.apps_integral_at_arrival
        average = apps / life if life > 0 else 1.0
        return independent_seconds(
            job.spec, self.total_gpus, average, self.per_node, rate_of=job.truth.rate
        )
