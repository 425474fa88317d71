"""The run's job: which signed `job` value counts (owned or open run), read with its signer.

The signer is the job's owner as far as the job's life is concerned: a stop request counts only when it
carries the same signature (`training.progress`).
"""

from __future__ import annotations

import logging

from ravnest_p2p.discovery import OWNERS_KEY, authorized_signers, dht_time
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import ProgressStore

__all__ = ["JOB_KEY", "pick_job", "pick_job_signed", "read_job", "read_job_signed"]

logger = logging.getLogger(__name__)

JOB_KEY = "job"


def pick_job_signed(
    found: dict[str, tuple[object, float]],
    *,
    run_owner: str | None = None,
    owners: dict[str, tuple[object, float]] | None = None,
) -> tuple[str, JobSpec] | None:
    """(signer, job) of the run's job among signed `job` values ({signer: (value, expiry)}); None if none.

    Open run (`run_owner` None): any signer's job; the one that expires last wins. Owned run: only jobs
    signed by the owner or by a key its ``owners`` record lists; a delegate's job counts only while that
    record lives, and its expiry is capped at the record's (the owner's say-so bounds it). The job with
    the latest (capped) expiry wins; on a tie the owner's. The ``job`` key's maximum TTL (one day, see
    `discovery.keys`) caps every expiry, the owner's too.
    """
    allowed = authorized_signers(run_owner, owners or {}) if run_owner is not None else None
    newest: tuple[float, bool, str, JobSpec] | None = None
    for signer, (value, expiration) in found.items():
        if allowed is not None:
            if signer not in allowed or allowed[signer] < dht_time():
                logger.debug("ignoring a job from %s: not an owner of this run", signer)
                continue
            expiration = min(expiration, allowed[signer])
        try:
            job = JobSpec.model_validate(value)
        except Exception as exc:
            logger.debug("ignoring malformed job from %s: %s", signer, exc)
            continue
        rank = (expiration, signer == run_owner)
        if newest is None or rank > newest[:2]:
            newest = (expiration, signer == run_owner, signer, job)
    return (newest[2], newest[3]) if newest else None


def pick_job(
    found: dict[str, tuple[object, float]],
    *,
    run_owner: str | None = None,
    owners: dict[str, tuple[object, float]] | None = None,
) -> JobSpec | None:
    """The run's job among signed `job` values (see `pick_job_signed`)."""
    picked = pick_job_signed(found, run_owner=run_owner, owners=owners)
    return picked[1] if picked else None


async def read_job_signed(dht: ProgressStore, *, run_owner: str | None = None) -> tuple[str, JobSpec] | None:
    """(signer, job) of the run's current job (see `pick_job_signed`); `run_owner` defaults to the DHT's."""
    run_owner = run_owner if run_owner is not None else dht.run_owner
    # the initial peers hold pinned copies (`RunClient.publish_job`): after every peer of a run restarted,
    # the replicas the DHT search reaches may all be restarted peers that lost the record
    found = await dht.get_signed(JOB_KEY, from_initial_peers=True)
    owners = (
        await dht.get_signed(OWNERS_KEY, from_initial_peers=True) if run_owner is not None and found else {}
    )
    return pick_job_signed(found, run_owner=run_owner, owners=owners)


async def read_job(dht: ProgressStore, *, run_owner: str | None = None) -> JobSpec | None:
    """The run's current job (see `pick_job_signed`); `run_owner` defaults to the DHT's."""
    picked = await read_job_signed(dht, run_owner=run_owner)
    return picked[1] if picked else None
