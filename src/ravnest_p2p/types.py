"""Frozen value types shared by several layers.

Wire records live next to the code that owns them (e.g. `discovery.records.PeerRecord`); this module
holds the small vocabulary everyone uses.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LayerProfile", "PeerState", "WireModel"]


class WireModel(BaseModel):
    """Base of records read from the network: frozen, strict numbers, no NaN/inf, unknown fields ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False, strict=False)


class PeerState(StrEnum):
    JOINING = "joining"
    READY = "ready"
    TRAINING = "training"
    DRAINING = "draining"


class LayerProfile(BaseModel):
    """Cost of one cuttable layer of a model, per sample where it scales with the batch.

    Produced by a dry run of the model (`models.profile`), consumed by the pure planner.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    name: str
    flops_per_sample: float = Field(ge=0)
    param_bytes: int = Field(ge=0)
    optimizer_state_bytes: int = Field(ge=0)
    activation_bytes_per_sample: int = Field(ge=0, description="bytes of this layer's output, per sample")
    trainable_bytes: int | None = Field(
        default=None, ge=0, description="bytes of trainable parameters (stash, gradient); None: param_bytes"
    )
    saved_bytes_per_sample: int = Field(
        default=0,
        ge=0,
        description="what autograd saves for backward (not parameters), per sample",
    )
