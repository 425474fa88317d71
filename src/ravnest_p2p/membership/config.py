"""Knobs of the membership service (gossip, stability, agreement, exclusion) and its stand-in workload."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.membership.epochs import Timing
from ravnest_p2p.planning import JobParams
from ravnest_p2p.types import LayerProfile

__all__ = ["DEFAULT_LAYERS", "MembershipConfig"]


def _layer(name: str, flops: float, params: int, act: int) -> LayerProfile:
    return LayerProfile(
        name=name,
        flops_per_sample=flops,
        param_bytes=params * 4,
        optimizer_state_bytes=params * 8,
        activation_bytes_per_sample=act * 4,
    )


# A stand-in job until the JobSpec lands: shaped like the registry's digits CNN (conv, conv, pool,
# dense, dense), per sample, fp32, Adam. A parameter of `MembershipConfig`, not a constant of the code.
DEFAULT_LAYERS: tuple[LayerProfile, ...] = (
    _layer("0:Conv2d", 2 * 8 * 9 * 64, 80, 8 * 64),
    _layer("1:Conv2d", 2 * 16 * 8 * 9 * 64, 1168, 16 * 64),
    _layer("2:MaxPool2d", 16 * 16, 0, 16 * 16),
    _layer("3:Linear", 2 * 256 * 64, 16448, 64),
    _layer("4:Linear", 2 * 64 * 10, 650, 10),
)


class MembershipConfig(BaseModel):
    """Gossip, stability and agreement knobs; tests shrink the durations."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    gossip_period_s: float = Field(default=1.0, gt=0)
    fanout: int = Field(default=3, ge=1, le=64)
    call_timeout_s: float = Field(default=2.0, gt=0)
    num_buckets: int = Field(default=16, ge=1, le=4096)
    stable_rounds: int = Field(default=3, ge=1)
    hysteresis_s: float = Field(default=3.0, ge=0)
    join_delay_s: float = Field(default=10.0, ge=0)
    grace_s: float = Field(default=15.0, ge=0)
    agreement_timeout_s: float = Field(default=30.0, gt=0)
    exclude_for_s: float = Field(default=120.0, ge=0)
    suspect_report_ttl_s: float = Field(default=60.0, gt=2)
    plan_ttl_s: float = Field(default=120.0, gt=2)
    # plan with the pairwise link matrix built from the records' measured links (see planning.links)
    plan_with_links: bool = True
    # keep the previous plan's clusters that are still whole (planning.replan); False: every plan from
    # scratch, seeded by its epoch (the behaviour before; for A/B measurements)
    keep_clusters: bool = True
    job: JobParams = JobParams(micro_batch_size=32)
    layers: tuple[LayerProfile, ...] = Field(default=DEFAULT_LAYERS, min_length=1)

    def timing(self) -> Timing:
        return Timing(
            stable_rounds=self.stable_rounds,
            hysteresis_s=self.hysteresis_s,
            join_delay_s=self.join_delay_s,
            grace_s=self.grace_s,
            agreement_timeout_s=self.agreement_timeout_s,
        )
