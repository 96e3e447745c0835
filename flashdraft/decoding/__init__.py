"""Speculative decoding: settings, a request's state and result, proposers, and the decoder that runs cycles.

Only the settings load with the package (the command line checks flags without torch); the rest on first use.
"""

import importlib

from .settings import DEFAULT_TREE, DecodeSettings, add_decode_arguments, settings_from, settings_from_args

_LAZY = {"Decoder": "decoder", "decode_batch": "decoder", "decode_stream": "decoder", "generate_ids": "decoder",
         "Proposal": "proposers", "Proposer": "proposers", "Cycle": "request", "GenerationResult": "request",
         "Request": "request", "Timing": "request", "mean_acceptance": "request"}

__all__ = ["DEFAULT_TREE", "DecodeSettings", "add_decode_arguments", "settings_from", "settings_from_args", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
