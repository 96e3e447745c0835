"""Speculative decoding: settings, state and results, proposers, the cycle, and the session that runs it."""

from .proposers import Proposal, Proposer
from .session import Session, generate_ids
from .settings import DEFAULT_TREE, DecodeSettings, add_decode_arguments, settings_from, settings_from_args
from .state import Cycle, DecodeState, GenerationResult, Timing, mean_acceptance

__all__ = ["DEFAULT_TREE", "Cycle", "DecodeSettings", "DecodeState", "GenerationResult", "Proposal", "Proposer",
           "Session", "Timing", "add_decode_arguments", "generate_ids", "mean_acceptance", "settings_from",
           "settings_from_args"]
