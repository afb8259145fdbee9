"""Strategies: how a model is wrapped so N ranks train it together, by registered name."""

from .base import Strategy
from .ddp import DDP
from .fsdp import FSDP
from .registry import describe, get, names, owner_of, register, release, unavailable
from .zero import Zero1

__all__ = ["DDP", "FSDP", "Strategy", "describe", "get", "names", "owner_of", "register",
           "release", "unavailable", "Zero1"]
