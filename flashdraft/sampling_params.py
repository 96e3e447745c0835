"""How a distribution is processed before sampling (temperature, top-k, top-p): the settings alone, without torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import FlashdraftError

# Temperatures below this decode greedily (as vLLM does): logits / T overflows float32 long before T reaches 0
# (1e-45 gives inf and NaN probabilities), and the distribution is already one-hot up to exact ties there.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN and inf too: logits / inf is NaN wherever a logit is -inf
            raise FlashdraftError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise FlashdraftError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise FlashdraftError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below MIN_TEMPERATURE."""
        return self.temperature < MIN_TEMPERATURE
