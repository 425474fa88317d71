"""Membership agreement: views of who is in the run, gossip to reconcile them, one plan per epoch."""

from ravnest_p2p.membership.agreement import (
    DEFAULT_LAYERS,
    MembershipConfig,
    MembershipService,
    RecordSource,
    plan_position,
)
from ravnest_p2p.membership.board import DhtPlanBoard, MemoryPlanBoard, PlanBoard, plan_key
from ravnest_p2p.membership.epochs import Action, EpochTracker, Phase, Timing
from ravnest_p2p.membership.gossip import GOSSIP_VIEW, Gossiper, GossipItem, GossipReply, GossipRequest
from ravnest_p2p.membership.view import Capacity, MembershipView, SummaryItem, ViewEntry, bucket_of

__all__ = [
    "DEFAULT_LAYERS",
    "GOSSIP_VIEW",
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
    "RecordSource",
    "SummaryItem",
    "Timing",
    "ViewEntry",
    "bucket_of",
    "plan_key",
    "plan_position",
]
