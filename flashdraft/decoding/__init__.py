"""Speculative decoding: settings, a request's state and result, proposers, and the decoder that runs cycles."""

from .decoder import Decoder, decode_batch, generate_ids
from .proposers import Proposal, Proposer
from .request import Cycle, GenerationResult, Request, Timing, mean_acceptance
from .settings import DEFAULT_TREE, DecodeSettings, add_decode_arguments, settings_from, settings_from_args

__all__ = ["DEFAULT_TREE", "Cycle", "DecodeSettings", "Decoder", "GenerationResult", "Proposal", "Proposer", "Request",
           "Timing", "add_decode_arguments", "decode_batch", "generate_ids", "mean_acceptance", "settings_from",
           "settings_from_args"]
