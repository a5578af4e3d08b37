"""The GPU tensors of vLLM v1 that outlive the step that made them.

A step's transients (kvgate/sim/step_memory.py) are all freed before the next step; these are not.
They sit in whatever cached block best fit found for them while later steps, of other shapes,
come and go around them, and a segment that holds one can never be given back whole:

- the sampler's outputs (sampled token ids; the top-k logprobs when a row asks for them): with
  async scheduling `AsyncGPUModelRunnerOutput` (v1/worker/gpu_model_runner.py) keeps "a
  reference to the device tensor to avoid it being deallocated until we finish copying it to
  the host", and lets go when the engine collects the output, once the next step is launched.
  Played: freed when the next step starts. They are tens of KiB, in the small pool.
- penalties' prompt ids (Model Runner V1 only): whenever a request of the persistent batch has a
  presence, frequency or repetition penalty, `InputBatch._make_prompt_token_ids_tensor`
  (v1/worker/gpu_input_batch.py) copies `[num_reqs, max_prompt_len]` int64 to the GPU as
  `SamplingMetadata.prompt_token_ids`. `refresh_metadata` rebuilds the metadata only when the
  batch changes (a request added, removed or moved), and the new tensor is made while the old
  metadata still holds the old one, so the new one lands beside it and, once the old one goes,
  sits inside the segment with free bytes on both sides. Megabytes to over 100 MiB. Model Runner
  V2 has no such tensor: `PenaltiesState` (v1/worker/gpu/sample/penalties.py, vLLM 0.31.0, 0.32.0
  and 0.33.0) counts the prompt into a `prompt_bin_mask` and `output_bin_counts` preallocated for
  max_num_reqs rows at start-up, from the token ids `RequestState` already holds.
- Model Runner V2's prompt logprobs of a prompt still being prefilled (v1/worker/gpu/sample/
  prompt_logprob.py:210-212 `in_progress_prompt_logprobs`, 0.32.0 and 0.33.0): each earlier
  step's results, held (`held`, keyed by request) until its last prompt step concatenates them,
  or until it leaves the batch (`remove_request` drops them).
"""

from __future__ import annotations

from kvgate.sim.gpu import Block, CachingAllocator
from kvgate.sim.request import Request

PROMPT_ID_BYTES = 8  # int64


class CrossStepTensors:
    """What one engine holds on its GPU from one step to the next."""

    def __init__(self, alloc: CachingAllocator, *, v1: bool) -> None:
        self.alloc = alloc
        self.v1 = v1  # Model Runner V1: the penalties' prompt ids are rebuilt with the batch
        self.outputs: list[Block] = []
        self.penalty_prompt_ids: Block | None = None
        self._batch: tuple[str, ...] = ()
        self.held: dict[str, list[Block]] = {}  # "held:pl:<request id>" -> V2 prompt logprobs

    def start_step(self, batch: list[Request]) -> None:
        """Before the forward pass: collect the last step's outputs, then refresh the sampling
        metadata if the batch changed. (In vLLM the collection overlaps the next step's start;
        the outputs are small-pool blocks, so the order moves nothing in the large pool.)"""
        for block in self.outputs:
            self.alloc.free(block)
        self.outputs = []
        running = {f"held:pl:{r.request_id}" for r in batch}
        for gone in [k for k in self.held if k not in running]:
            for block in self.held.pop(gone):
                self.alloc.free(block)
        key = tuple(r.request_id for r in batch)
        if key == self._batch:
            return
        self._batch = key
        old, self.penalty_prompt_ids = self.penalty_prompt_ids, None
        if self.v1 and any(r.sampling.penalties for r in batch):
            longest = max(r.num_prompt_tokens for r in batch)
            self.penalty_prompt_ids = self.alloc.malloc(len(batch) * longest * PROMPT_ID_BYTES)
        if old is not None:
            self.alloc.free(old)

    def keep_outputs(self, blocks: list[Block]) -> None:
        """The step's sampler outputs, held until the next step collects them."""
        self.outputs = blocks
