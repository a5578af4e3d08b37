"""A request inside the simulated engine: its tokens, progress and sampling needs."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgate.sim.vision import Item


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters that change what a step allocates."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    penalties: bool = False
    structured: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # no end of sequence before this many (vllm/v1/core/sched/utils.py check_stop)
    min_p: float = 0.0
    # logit_bias, allowed_token_ids, bad_words or min_tokens: a V2 logits processor runs
    logits_processor: bool = False

    @property
    def random(self) -> bool:
        return self.temperature > 1e-5

    @property
    def processes_logits(self) -> bool:
        """Model Runner V2 copies the batch's logits to fp32 for this row (vllm 0.32.0/0.33.0
        v1/worker/gpu/sample/states.py:67-72 `SamplingStates.add_request`: a random row whose
        temperature is not 1.0 or that sets top-k/top-p/min-p; the logits processors of
        penalties.py:55-64, logit_bias.py:57-110 and bad_words.py:40-44, greedy rows too)."""
        own = self.random and (self.temperature != 1.0 or self.min_p != 0.0 or self.top_p_k)
        return own or self.penalties or self.logits_processor

    @property
    def top_p_k(self) -> bool:
        return self.random and (self.top_p < 1.0 or self.top_k > 0)


@dataclass
class Request:
    """One sequence; `n > 1` requests are fanned out into n of these, as vLLM v1 does."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    arrival_time: float
    sink: Callable[[str, Any], None] = lambda kind, data: None
    stream_seed: int = 0  # picks the deterministic output text
    cache_salt: str | None = None  # an extra key of its first KV block's hash (kvgate/sim/blocks.py)
    mm_items: list[Item] = field(default_factory=list)  # its images' tokens (kvgate/sim/vision.py)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
