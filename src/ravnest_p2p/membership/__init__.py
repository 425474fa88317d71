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
from ravnest_p2p.membership.epochs import Action, EpochTracker, Phase, Timing
from ravnest_p2p.membership.gossip import GOSSIP_VIEW, Gossiper, GossipItem, GossipReply, GossipRequest
from ravnest_p2p.membership.view import Capacity, MembershipView, SummaryItem, ViewEntry, bucket_of

__all__ = [
    "DEFAULT_LAYERS",
    "GOSSIP_VIEW",
    "PLAN_KEY",
    "Action",
    "Capacity",
    "DhtPlanBoard",
    "EpochTracker",
    "GossipItem",
    "GossipReply",
    "GossipRequest",
    "Gossiper",
    "MembershipConfig",
    "MembershipService",
    "MembershipView",
    "MemoryPlanBoard",
    "Phase",
    "PlanBoard",
    "PlanRecord",
    "RecordSource",
    "SummaryItem",
    "Timing",
    "ViewEntry",
    "bucket_of",
    "parse_plan",
    "plan_position",
]
