"""The peer's composition root: identity → host → DHT → probes → announcer and directory.

Nothing here decides anything; it builds the parts from one `PeerConfig`, starts their loops under one
`TaskOwner`, and closes them in reverse order.
"""

from __future__ import annotations

import asyncio
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ravnest_p2p import __version__
from ravnest_p2p.discovery import Announcer, PeerDirectory, PeerRecord, RunDHT, dht_time
from ravnest_p2p.measurement import NetworkMeter, ProbeConfig, free_memory_bytes, measure_matmul_flops
from ravnest_p2p.membership import DhtPlanBoard, MembershipConfig, MembershipService
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.placement import assignment_from_plan, job_params, layer_profiles
from ravnest_p2p.training.run_keys import run_keys
from ravnest_p2p.training.runner import Placement, StageRunner, find_placement, read_job
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity
from ravnest_p2p.types import PeerState
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = ["EmulationConfig", "Peer", "PeerConfig", "PeerStatus", "rerun_allowed"]

_ADDRESSES_S = 30.0

logger = logging.getLogger(__name__)


class EmulationConfig(BaseModel):
    """Lab-only: scale/cap the figures a peer *reports*, to fake heterogeneity on one machine (loopback).

    Never set this on a real volunteer: it makes the peer lie (within the record's valid ranges).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    flops_scale: float = Field(default=1.0, gt=0, le=1e3)
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

    def line(self) -> str:
        rtt = f"{self.rtt_ms:.1f} ms" if self.rtt_ms is not None else "-"
        return (
            f"state={self.state} peers={self.num_peers_seen} compute={self.flops / 1e9:.1f} GFLOP/s "
            f"up={self.upload_mbps:.1f} Mbit/s down={self.download_mbps:.1f} Mbit/s rtt={rtt}"
        )


def rerun_allowed(failed_epoch: int | None, plan_epoch: int) -> bool:
    """Whether a job on the agreed plan may run on `plan_epoch` here, given the epoch it failed on.

    A failed job is retried only on a newer plan: the same plan would fail the same way (e.g. a dead
    stage in our cluster), and a plan is how the swarm routes around the fault.
    """
    return failed_epoch is None or plan_epoch > failed_epoch


class Peer:
    """A running volunteer peer. Create with `await Peer.start(config)`; close with `await peer.aclose()`."""

    def __init__(self, config: PeerConfig, transport: P2PTransport, dht: RunDHT) -> None:
        self.config = config
        self.transport = transport
        self.dht = dht
        self.rpc = RpcEndpoint(transport, config.run_id)
        self.meter = NetworkMeter(self.rpc, config.probe)
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
        self._tasks = TaskOwner(f"peer-{transport.peer_id[-6:]}")
        self._closed = False
        self.jobs_done: set[str] = set()
        self._failed_epoch: dict[str, int] = {}  # job id -> agreed-plan epoch it last failed on here
        self._workload_job: str | None = None
        self.runner: StageRunner | None = None

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
        self.flops = await run_in_compute_thread(measure_matmul_flops, self.config.device, self.config.dtype)
        self.state = PeerState.READY
        await self.announcer.publish_once()
        self._tasks.spawn(self.announcer.run(), name="announce")
        self._tasks.spawn(self.directory.run(), name="directory")
        self._tasks.spawn(self.meter.run(self._probe_candidates, self.announcer.refresh_soon), name="probe")
        if self.membership is not None:
            await self.membership.serve()
            self.membership.add_listener(lambda _plan: self.announcer.refresh_soon())
            self._tasks.spawn(self.membership.run(), name="membership")
        self._tasks.spawn(self._job_loop(), name="jobs")
        logger.info("peer %s ready: %.1f GFLOP/s", self.peer_id, self.flops / 1e9)
        if self.config.run_owner is None:
            logger.warning(
                "run %r has no owner: this peer trains anyone's job (see --run-owner)", self.config.run_id
            )

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    async def _place_on_agreed_plan(self, job: JobSpec) -> tuple[JobSpec | None, int]:
        """A job without an assignment runs on the membership's agreed plan, once one exists for it.

        Every peer that reads the job asks the membership to plan for the job's layer profile (computed
        from the registry, so identical everywhere); the job runs when a plan made for it is active.
        """
        if self.membership is None:
            return None, 0
        if self._workload_job != job.job_id:
            params, layers = await run_in_compute_thread(lambda: (job_params(job), layer_profiles(job)))
            self.membership.set_workload(job.job_id, params, layers)
            self._workload_job = job.job_id
        plan = self.membership.active_plan
        if plan is None or self.membership.active_workload != job.job_id:
            return None, 0
        return job.model_copy(update={"assignment": assignment_from_plan(plan)}), plan.epoch

    async def _job_loop(self) -> None:
        """Watch the run's job; train our stage of each new job that places us."""
        while True:
            try:
                job = await read_job(self.dht)
            except Exception as exc:
                logger.debug("reading the job failed: %r", exc)
                job = None
            placement = None
            on_agreed_plan = False
            if job is not None and job.job_id not in self.jobs_done:
                if job.assignment is None:
                    on_agreed_plan = True
                    failed_epoch = self._failed_epoch.get(job.job_id)
                    job, epoch = await self._place_on_agreed_plan(job)
                    if job is not None and rerun_allowed(failed_epoch, epoch):
                        placement = find_placement(job, self.peer_id, epoch=epoch)
                else:
                    placement = find_placement(job, self.peer_id)
            if job is not None and placement is not None:
                await self._run_stage(job, placement, on_agreed_plan=on_agreed_plan)
            await asyncio.sleep(self.config.job_poll_s)

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

    async def _run_stage(self, job: JobSpec, placement: Placement, *, on_agreed_plan: bool) -> None:
        """Train our stage; on an agreed plan, start over if the swarm moves to another plan meanwhile.

        Re-planning mid-job (a peer lost or joined past the grace period) restarts the job on the new
        plan from its initial weights: moving trained stages to new owners (`fetch_shard`) is not built.
        """
        logger.info(
            "job %s: stage %d of %d in cluster %d (epoch %d)",
            job.job_id,
            placement.stage_index,
            len(placement.stages),
            placement.cluster_index,
            placement.epoch,
        )
        self.jobs_done.add(job.job_id)
        self.state = PeerState.TRAINING
        self.announcer.refresh_soon()
        partners = [s.peer_id for c in job.assignment for s in c] if job.assignment else placement.peers
        await self._learn_addresses(partners)
        self.runner = StageRunner(self.rpc, self.dht, job, placement)
        run = self._tasks.spawn(self.runner.run(), name=f"job-{job.job_id}")
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=self.config.job_poll_s)
                plan = self.membership.active_plan if self.membership is not None else None
                if on_agreed_plan and not run.done() and plan is not None and plan.epoch != placement.epoch:
                    logger.info("plan moved to epoch %d: restarting job %s on it", plan.epoch, job.job_id)
                    run.cancel()
                    await asyncio.wait({run})
                    self.jobs_done.discard(job.job_id)
                    return
            final = run.result()
            logger.info("job %s finished: step %d loss %s", job.job_id, final.step, final.loss)
        except asyncio.CancelledError:
            run.cancel()
            raise
        except Exception as exc:
            logger.error("job %s failed on this peer: %s", job.job_id, exc)
            if on_agreed_plan:
                # e.g. a pipeline partner died: the swarm re-plans without it, and we run again there
                self._failed_epoch[job.job_id] = placement.epoch
                self.jobs_done.discard(job.job_id)
        finally:
            self.state = PeerState.READY
            self.announcer.refresh_soon()

    @property
    def maddrs(self) -> list[str]:
        return list(self._maddrs)

    def _probe_candidates(self) -> list[str]:
        return [
            pid for pid, rec in self.directory.active(exclude=self.peer_id).items() if not rec.client_mode
        ]

    def _make_record(self) -> PeerRecord:
        up, down, rtt = self.meter.summary()
        flops, emulate = self.flops, self.config.emulate
        if emulate is not None:
            flops *= emulate.flops_scale
            up = min(up, emulate.upload_mbps or up)
            down = min(down, emulate.download_mbps or down)
        epoch, cluster, stage = self.membership.position() if self.membership else (0, None, None)
        return PeerRecord(
            peer_id=self.peer_id,
            maddrs=tuple(self._maddrs),
            software_version=f"ravnest_p2p/{__version__} py/{platform.python_version()}",
            device=self.config.device,
            flops=flops,
            free_memory_bytes=free_memory_bytes(self.config.device, cap_gb=self.config.max_memory_gb),
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
        )

    async def aclose(self, *, drain: bool = True) -> None:
        """Announce draining (unless told not to), stop every loop, leave the DHT, stop the daemon."""
        if self._closed:
            return
        self._closed = True
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
