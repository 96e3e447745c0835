"""Speculative decoding: settings, state and results, proposers, the cycle, and the session that runs it."""

from .settings import DEFAULT_TREE, DecodeSettings, add_decode_arguments, settings_from_args

__all__ = ["DEFAULT_TREE", "DecodeSettings", "add_decode_arguments", "settings_from_args"]
