"""What a request asks for, and its checks, in plain Python: the sampling settings (which
edgetp.model.sampling applies) and the error of a prompt that cannot run.

Outside edgetp.model (whose package loads LLVM as it sets numba's target) so that a command
that only asks a cluster (`edgetp ask`, `chat`) checks its options without numba or LLVM.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CANDIDATES = 256  # top_k == 0 ("all") is capped here; see Candidates.complete
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


class ContextError(ValueError):
    """The prompt and answer do not fit the context (or the prompt is not text)."""


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    frequency_penalty: float = 0.0  # subtracted once per time a token occurs in the last repeat_last_n
    presence_penalty: float = 0.0   # subtracted once from each token that occurs there
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), before the penalties
    logprobs: int | None = None  # None: none; n: each token's log probability and the n likeliest beside it

    def __post_init__(self) -> None:
        # pairs as a frame carries them (lists), sorted: equal settings compare equal
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in self.logit_bias)))
        if self.seed is not None:  # any integer, as OpenAI's seed (numpy's generator takes 0..2^64-1): -1 is 2^64-1
            object.__setattr__(self, "seed", int(self.seed) % 2**64)
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise SamplingError("logit_bias takes token ids >= 0 and biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise SamplingError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise SamplingError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def k(self) -> int:
        """How many candidates each shard must send."""
        if self.greedy:
            return 1
        return min(self.top_k or MAX_CANDIDATES, MAX_CANDIDATES)
