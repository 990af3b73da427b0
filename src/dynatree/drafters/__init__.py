"""Drafters propose next-token candidates for tree nodes (see `base.Drafter`)."""

from .base import Drafter, Proposal
from .feature import FeatureDrafter
from .hybrid import HybridDrafter
from .lm import LMDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "Proposal", "FeatureDrafter", "HybridDrafter", "LMDrafter", "NgramDrafter"]
