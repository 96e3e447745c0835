"""flashdraft: lossless speculative decoding with block-diffusion (DFlash) drafters."""

from .api import generate, generate_batch
from .checkpoint import load_drafter, save_drafter
from .decoding import DecodeSettings, GenerationResult, generate_ids
from .errors import FlashdraftError
from .models import Target, load_drafter_for, load_target

__all__ = ["generate", "generate_batch", "generate_ids", "DecodeSettings", "load_target", "load_drafter", "load_drafter_for", "save_drafter",
           "GenerationResult", "FlashdraftError", "Target"]
__version__ = "0.1.0"
