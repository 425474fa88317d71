"""Membership agreement: views of who is in the run, gossip to reconcile them, one plan per epoch."""

from ravnest_p2p.membership.agreement import (
    DEFAULT_LAYERS,
    MembershipConfig,
    MembershipService,
    RecordSource,
    plan_position,
)
from ravnest_p2p.membership.board import (
    PLAN_KEY,
    DhtPlanBoard,
    MemoryPlanBoard,
    PlanBoard,
    PlanRecord,
    parse_plan,
)
from ravnest_p2p.membership.epochs import MAX_EPOCH, Action, EpochTracker, Phase, Timing, backed_epoch
from ravnest_p2p.membership.gossip import (
    GOSSIP_VIEW,
    Gossiper,
    GossipItem,
    GossipLimits,
    GossipReply,
    GossipRequest,
)
from ravnest_p2p.membership.suspects import (
    SUSPECTS_KEY,
    DhtSuspectBoard,
    MemorySuspectBoard,
    Suspect,
    SuspectBoard,
    SuspectKind,
    SuspectReport,
)
from ravnest_p2p.membership.view import Capacity, MembershipView, SummaryItem, ViewEntry, bucket_of

__all__ = [
    "DEFAULT_LAYERS",
    "GOSSIP_VIEW",
    "MAX_EPOCH",
    "PLAN_KEY",
    "SUSPECTS_KEY",
    "Action",
    "Capacity",
    "DhtPlanBoard",
    "DhtSuspectBoard",
    "EpochTracker",
    "GossipItem",
    "GossipLimits",
    "GossipReply",
    "GossipRequest",
    "Gossiper",
    "MembershipConfig",
    "MembershipService",
    "MembershipView",
    "MemoryPlanBoard",
    "MemorySuspectBoard",
    "Phase",
    "PlanBoard",
    "PlanRecord",
    "RecordSource",
    "SummaryItem",
    "Suspect",
    "SuspectBoard",
    "SuspectKind",
    "SuspectReport",
    "Timing",
    "ViewEntry",
    "backed_epoch",
    "bucket_of",
    "parse_plan",
    "plan_position",
]
