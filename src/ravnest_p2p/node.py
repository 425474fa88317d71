"""The peer's composition root: identity → host → DHT → probes → announcer, directory, membership, jobs.

Nothing here decides anything; it builds the parts from one `PeerConfig`, starts their loops under one
`TaskOwner`, and closes them in reverse order. A job's life is the `training.supervisor.JobSupervisor`'s.
"""

from __future__ import annotations

import asyncio
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ravnest_p2p._version import __version__
from ravnest_p2p.discovery import (
    MAX_LINKS,
    Announcer,
    LinkRecord,
    PeerDirectory,
    PeerRecord,
    RunDHT,
    dht_time,
)
from ravnest_p2p.discovery.records import MAX_FLOPS, MAX_RTT_MS
from ravnest_p2p.measurement import (
    LinkPublisher,
    NetworkMeter,
    ProbeConfig,
    framework_overhead_bytes,
    free_memory_bytes,
    measure_matmul_flops,
    memory_snapshot,
    release_free_memory,
    remeasure_matmul_flops,
    steady_memory_bytes,
)
from ravnest_p2p.measurement.compute_refresh import ComputeRefresher
from ravnest_p2p.membership import DhtPlanBoard, MembershipConfig, MembershipService
from ravnest_p2p.planning import JobParams
from ravnest_p2p.training.handover import HandoverServer
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.mode_runner import start_mode_runner
from ravnest_p2p.training.placement import job_params, layer_profiles
from ravnest_p2p.training.plugins import advertised_plugins
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.run_keys import run_keys
from ravnest_p2p.training.runner import StageRunner
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.training.state_source import HandoverStateSource
from ravnest_p2p.training.supervisor import JobSupervisor, StageRun, SupervisorConfig, rerun_allowed
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity
from ravnest_p2p.types import LayerProfile, PeerState
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = ["EmulationConfig", "Peer", "PeerConfig", "PeerStatus", "rerun_allowed"]  # rerun_allowed: moved

_ADDRESSES_S = 30.0

logger = logging.getLogger(__name__)


class EmulationConfig(BaseModel):
    """Lab-only: scale/cap the figures a peer *reports*, to fake heterogeneity on one machine (loopback).

    Never set this on a real volunteer: it makes the peer lie (within the record's valid ranges).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    flops_scale: float = Field(default=1.0, gt=0, le=1e3)
    # the compute figure to report instead of measuring one (then scaled by flops_scale): a test's plan
    # must not depend on how busy the host was when its peers started; never re-measured
    flops_per_s: float | None = Field(default=None, ge=1e6, le=MAX_FLOPS)
    upload_mbps: float | None = Field(default=None, gt=0)
    download_mbps: float | None = Field(default=None, gt=0)


class PeerConfig(BaseModel):
    """Everything a peer needs to start. The CLI flags and `--config FILE` both fill this."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(default="default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    # the owner's peer id: only its jobs (or those of keys it lists) are trained; None: an open run
    run_owner: str | None = Field(
        default=None, min_length=10, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$"
    )
    initial_peers: tuple[str, ...] = ()
    identity_path: Path | None = None
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    max_memory_gb: float | None = Field(default=None, gt=0)
    record_ttl_s: float = Field(default=45.0, gt=2)
    directory_refresh_s: float = Field(default=3.0, gt=0)
    status_interval_s: float = Field(default=10.0, gt=0)
    check_identity_free: bool = True
    job_poll_s: float = Field(default=2.0, gt=0)
    drain_grace_s: float = Field(default=30.0, ge=0, le=300)
    # a running peer re-measures its compute this often, while not training (0: never); see
    # measurement/compute_refresh.py
    compute_refresh_s: float = Field(default=3600.0, ge=0)
    # where this peer keeps its stages' checkpoints when a job asks for them (None: $RAVNEST_CHECKPOINT_DIR,
    # else none are kept)
    checkpoint_dir: Path | None = None
    probe: ProbeConfig = ProbeConfig()
    membership: MembershipConfig = MembershipConfig()
    emulate: EmulationConfig | None = None

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith(("cuda", "mps")):
            raise ValueError("device must be cpu, cuda[:N] or mps")
        return value


@dataclass(frozen=True)
class PeerStatus:
    peer_id: str
    state: PeerState
    num_peers_seen: int
    flops: float
    upload_mbps: float
    download_mbps: float
    rtt_ms: float | None
    unfit: str | None = None  # "job <id>: why this peer cannot serve it"

    def line(self) -> str:
        rtt = f"{self.rtt_ms:.1f} ms" if self.rtt_ms is not None else "-"
        line = (
            f"state={self.state} peers={self.num_peers_seen} compute={self.flops / 1e9:.1f} GFLOP/s "
            f"up={self.upload_mbps:.1f} Mbit/s down={self.download_mbps:.1f} Mbit/s rtt={rtt}"
        )
        return line + (f" cannot-serve: {self.unfit}" if self.unfit else "")


class Peer:
    """A running volunteer peer. Create with `await Peer.start(config)`; close with `await peer.aclose()`."""

    def __init__(self, config: PeerConfig, transport: P2PTransport, dht: RunDHT) -> None:
        self.config = config
        self.transport = transport
        self.dht = dht
        self.rpc = RpcEndpoint(transport, config.run_id)
        self.meter = NetworkMeter(self.rpc, config.probe)
        self.link_publisher = LinkPublisher(max_links=MAX_LINKS)
        # nobody dials a client-mode peer: it dials the peers it reads, or its DHT reaches only its
        # initial peers (see `discovery.dht`)
        self.directory = PeerDirectory(
            dht, transport, refresh_period_s=config.directory_refresh_s, dial_new_peers=config.client_mode
        )
        self.announcer = Announcer(dht, self._make_record, ttl_s=config.record_ttl_s)
        self.membership = (
            MembershipService(config.membership, self.rpc, self.directory, DhtPlanBoard(dht))
            if config.membership.enabled
            else None
        )
        self.state = PeerState.JOINING
        self.flops = 0.0
        self._maddrs: list[str] = []
        self._plugins = advertised_plugins()
        self._tasks = TaskOwner(f"peer-{transport.peer_id[-6:]}")
        self._closed = False
        self._overhead_bytes: int | None = None
        self._published_memory: int | None = None  # the free memory last put in the record
        self.supervisor = JobSupervisor(
            SupervisorConfig(poll_s=config.job_poll_s, drain_grace_s=config.drain_grace_s),
            peer_id=transport.peer_id,
            dht=dht,
            plans=self.membership,
            workload=self._workload,
            start_runner=self._start_runner,
            state_source=HandoverStateSource(self.rpc, dht=dht, checkpoint_dir=config.checkpoint_dir),
            suspects=self.membership,
            serve_to=self._serve_state_to,
            alive=lambda: set(self.directory.peers),  # draining peers still serve their state
            prepare=self._prepare,
            on_state=self._set_state,
            on_unfit=self.announcer.refresh_soon,
        )

    @classmethod
    async def start(cls, config: PeerConfig) -> Peer:
        identity = load_or_create_identity(config.identity_path)
        host = HostConfig(
            initial_peers=config.initial_peers,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs,
            use_relay=config.use_relay,
            use_auto_relay=config.use_auto_relay,
            client_mode=config.client_mode,
            check_identity_free=config.check_identity_free,
        )
        transport = await P2PTransport.create(host, identity)
        try:
            dht = await RunDHT.create(
                transport,
                run_id=config.run_id,
                initial_peers=config.initial_peers,
                client_mode=config.client_mode,
                keys=run_keys(),
                run_owner=config.run_owner,
            )
        except BaseException:
            await transport.aclose()
            raise
        peer = cls(config, transport, dht)
        try:
            await peer._start()
        except BaseException:
            await peer.aclose()
            raise
        return peer

    async def _start(self) -> None:
        self._maddrs = [] if self.config.client_mode else await self.transport.visible_maddrs()
        await self.meter.serve()
        pinned_flops = self.config.emulate.flops_per_s if self.config.emulate is not None else None
        if pinned_flops is None:
            self.flops = await run_in_compute_thread(
                measure_matmul_flops, self.config.device, self.config.dtype
            )
        else:
            self.flops = pinned_flops
        self.state = PeerState.READY
        await self.announcer.publish_once()
        self._tasks.spawn(self.announcer.run(), name="announce")
        self._tasks.spawn(self.directory.run(), name="directory")
        self._tasks.spawn(
            self.meter.run(self._probe_candidates, self.announcer.refresh_soon, self._probe_priority),
            name="probe",
        )
        if self.membership is not None:
            await self.membership.serve()
            self.membership.add_listener(lambda _plan: self.announcer.refresh_soon())
            self._tasks.spawn(self.membership.run(), name="membership")
        self._tasks.spawn(self.supervisor.run(), name="jobs")
        if self.config.compute_refresh_s > 0 and pinned_flops is None:
            self._tasks.spawn(self._compute_refresher().run(), name="compute-refresh")
        logger.info("peer %s ready: %.1f GFLOP/s", self.peer_id, self.flops / 1e9)
        if self.config.run_owner is None:
            logger.warning(
                "run %r has no owner: this peer trains anyone's job (see --run-owner)", self.config.run_id
            )

    def _compute_refresher(self) -> ComputeRefresher:
        async def remeasure() -> float | None:
            return await run_in_compute_thread(remeasure_matmul_flops, self.config.device, self.config.dtype)

        def changed(flops: float) -> None:
            self.flops = flops
            self.announcer.refresh_soon()

        return ComputeRefresher(
            period_s=self.config.compute_refresh_s,
            is_idle=lambda: self.state == PeerState.READY,
            remeasure=remeasure,
            current=lambda: self.flops,
            on_change=changed,
        )

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def jobs_done(self) -> set[str]:
        """Jobs this peer will not run again (done, stopped, ended)."""
        return self.supervisor.finished

    @property
    def runner(self) -> StageRunner | None:
        runner = self.supervisor.runner
        return runner if isinstance(runner, StageRunner) else None

    def _start_runner(self, job: JobSpec, role: StageRole, state: StageState | None) -> StageRun:
        report = self.membership.report_misbehaviour if self.membership is not None else None
        available = self._free_memory_bytes() if self.config.max_memory_gb is not None else None
        runner = start_mode_runner(
            self.rpc, self.dht, job, role, state, on_exclude=report, memory_available_bytes=available
        )
        if isinstance(runner, StageRunner):
            runner.checkpoint_dir = self.config.checkpoint_dir
            runner.memory_available_bytes = available
        return runner

    def _serve_state_to(self, job_id: str, epoch: int, peer_ids: frozenset[str]) -> None:
        HandoverServer.of(self.rpc).allow(job_id, peer_ids, epoch=epoch)

    async def _prepare(self, role: StageRole) -> None:
        await self._learn_addresses(sorted(role.plan_peers))

    def _set_state(self, state: PeerState) -> None:
        self.state = state
        self.announcer.refresh_soon()

    async def leave(self, grace_s: float | None = None) -> None:
        """A graceful leave (SIGTERM): announce draining so the swarm re-plans, hand the stage over
        (keep its state for the new owners for at most `grace_s`, default `drain_grace_s`), then return;
        the caller closes the peer."""
        if self._closed:
            return
        self.state = PeerState.DRAINING
        await self.announcer.publish_once()
        await self.supervisor.drain(grace_s)

    async def _learn_addresses(self, peer_ids: list[str]) -> None:
        """Read the job's peers' records (their addresses), for at most `_ADDRESSES_S`.

        The transport dials a peer by the addresses its record gives; without them the daemon's own
        routing answers "routing: not found" for a peer it never met. A job published with an assignment
        can reach this peer before its directory read the other peers' records (lab CI run: a stage's
        first forwards to its neighbour failed 3 times within a second and the stage failed).
        """
        deadline = asyncio.get_running_loop().time() + _ADDRESSES_S
        while True:
            missing = [p for p in peer_ids if p != self.peer_id and p not in self.directory.peers]
            if not missing:
                return
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("no record (addresses) of %d job peers, e.g. %s", len(missing), missing[0])
                return
            try:
                await self.directory.refresh()
            except Exception as exc:  # a DHT hiccup: try again until the deadline
                logger.debug("directory refresh failed: %r", exc)
            if any(p not in self.directory.peers for p in missing):
                await asyncio.sleep(0.5)  # polling the DHT, bounded by the deadline

    @property
    def maddrs(self) -> list[str]:
        return list(self._maddrs)

    def _probe_candidates(self) -> list[str]:
        return [
            pid for pid, rec in self.directory.active(exclude=self.peer_id).items() if not rec.client_mode
        ]

    def _probe_priority(self) -> frozenset[str]:
        return self.membership.probe_priority() if self.membership is not None else frozenset()

    def _published_links(self) -> tuple[LinkRecord, ...]:
        """The measured links for the record (stable set, steady figures: see `measurement.links`)."""
        emulate = self.config.emulate
        chosen = self.link_publisher.select(
            self.meter.links,
            alive=self._probe_candidates(),
            priority=self._probe_priority(),
            up_cap_mbps=emulate.upload_mbps if emulate is not None else None,
            down_cap_mbps=emulate.download_mbps if emulate is not None else None,
        )
        return tuple(
            LinkRecord(
                peer_id=link.peer_id,
                up_mbps=link.up_mbps,
                down_mbps=link.down_mbps,
                rtt_ms=min(link.rtt_ms, MAX_RTT_MS),
            )
            for link in chosen
        )

    async def _workload(self, job: JobSpec) -> tuple[JobParams, list[LayerProfile]]:
        """What the membership plans a job with: its params and layer profile (a dry run of the model).

        The dry run leaves some memory resident that the process cannot give back (freed heap pages in
        use by fragments, allocator caches): the overhead is measured again after it, so what the peer
        announces and checks its stage against is what is really left (docs/memory.md).
        """
        logger.debug("memory at dry run start: %s", memory_snapshot().describe())
        layers = await run_in_compute_thread(layer_profiles, job)
        logger.debug("memory after the dry run: %s", memory_snapshot().describe())
        release_free_memory()
        logger.debug("memory after trim: %s", memory_snapshot().describe())
        overhead = framework_overhead_bytes()
        if self._overhead_bytes is None or overhead > self._overhead_bytes:
            self._overhead_bytes = overhead
            logger.info("framework overhead: %.0f MiB after the dry run of %s", overhead / 2**20, job.model)
            self.announcer.refresh_soon()
        return job_params(job, num_layers=len(layers)), layers

    def _free_memory_bytes(self) -> int:
        """Memory for stages: the cap minus this peer's own baseline, measured once (`measurement.memory`)."""
        if self._overhead_bytes is None:
            self._overhead_bytes = framework_overhead_bytes()
            logger.info("framework overhead: %.0f MiB (process and p2p daemon)", self._overhead_bytes / 2**20)
        measured = free_memory_bytes(
            self.config.device, cap_gb=self.config.max_memory_gb, overhead_bytes=self._overhead_bytes
        )
        if self.config.max_memory_gb is None:  # the OS's figure jitters; cap - overhead does not
            measured = steady_memory_bytes(self._published_memory, measured)
        self._published_memory = measured
        return measured

    def _make_record(self) -> PeerRecord:
        up, down, rtt = self.meter.summary()
        flops, emulate = self.flops, self.config.emulate
        if emulate is not None:
            flops *= emulate.flops_scale
            up = min(up, emulate.upload_mbps or up)
            down = min(down, emulate.download_mbps or down)
        links = self._published_links()
        epoch, cluster, stage = self.membership.position() if self.membership else (0, None, None)
        unfit_job, unfit_reason = self.supervisor.unfit or (None, None)
        return PeerRecord(
            peer_id=self.peer_id,
            maddrs=tuple(self._maddrs),
            software_version=f"ravnest_p2p/{__version__} py/{platform.python_version()}",
            device=self.config.device,
            flops=flops,
            free_memory_bytes=self._free_memory_bytes(),
            upload_mbps=up,
            download_mbps=down,
            rtt_ms=rtt,
            state=self.state,
            client_mode=self.config.client_mode,
            epoch=epoch,
            cluster=cluster,
            stage=stage,
            run_owner=self.config.run_owner,
            updated_at=dht_time(),
            links=links,
            plugin_models=self._plugins[0],
            plugin_datasets=self._plugins[1],
            unfit_job=unfit_job,
            unfit_reason=unfit_reason,
            placement=self.membership.placement() if self.membership else None,
        )

    def status(self) -> PeerStatus:
        up, down, rtt = self.meter.summary()
        return PeerStatus(
            peer_id=self.peer_id,
            state=self.state,
            num_peers_seen=len(self.directory.active(exclude=self.peer_id)),
            flops=self.flops,
            upload_mbps=up,
            download_mbps=down,
            rtt_ms=rtt,
            unfit=f"job {self.supervisor.unfit[0]}: {self.supervisor.unfit[1]}"
            if self.supervisor.unfit
            else None,
        )

    async def aclose(self, *, drain: bool = True) -> None:
        """Announce draining (unless told not to), stop every loop, leave the DHT, stop the daemon."""
        if self._closed:
            return
        self._closed = True
        await self.supervisor.aclose()
        await self._tasks.aclose()
        if self.membership is not None:
            await self.membership.aclose()
        if drain and self.state != PeerState.JOINING:
            self.state = PeerState.DRAINING
            await self.announcer.drain()
        await self.dht.aclose()
        await self.transport.aclose()

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
