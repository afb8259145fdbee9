"""Strategies: how a model is wrapped so N ranks train it together, by registered name."""

from .base import Strategy
from .ddp import DDP
from .fsdp import FSDP
from .registry import describe, get, names, register, unavailable
from .zero import Zero1

__all__ = ["DDP", "FSDP", "Strategy", "describe", "get", "names", "register",
           "unavailable", "Zero1"]
