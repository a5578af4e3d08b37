"""The simulator's MLA prefill (vLLM 0.32.0 model_executor/layers/attention/mla_attention.py),
read by the simulator from config.json on its own: what the start-up profile sees and what a
chunk over a long computed context adds."""

from __future__ import annotations

from kvgate.sim import startup
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.presets import gpu_total_bytes
from kvgate.sim.step_memory import ReqSlice, StepShape, run_tape
from kvgate.units import MiB

# DeepSeek-V2-Lite: 16 heads, qk_nope 128, qk_rope 64, v 128, bf16.
LITE = dict(model="deepseek-v2-lite", gpu="h100-80gb", max_model_len=131072, max_num_batched_tokens=2048)


def _boot(**kw) -> tuple[startup.Resolved, startup.StartupReport]:
    cfg = SimConfig(**{**LITE, **kw})
    dev = Device(gpu_total_bytes(cfg.gpu))
    return startup.start(cfg, load_model(cfg.model), dev, CachingAllocator(dev, "vllm"))


def test_profile_allocates_the_context_up_projection_stand_in() -> None:
    """`forward_impl` without attention metadata allocates `[W, heads, nope + v]`: with the 64k
    workspace 65536 x 16 x 256 x 2 B = 512 MiB inside the profile's peak (none without MLA)."""
    r, mla = _boot()
    assert r.mla_workspace_tokens == 64 * 1024
    _, flash = _boot(attention_backend="flash-attn")
    assert mla.activation_peak >= 512 * MiB > flash.activation_peak


def _peak(r: startup.Resolved, context: int) -> int:
    alloc = CachingAllocator(Device(1 << 40), "vllm")
    steps, _ = startup.step_memories(r)
    run_tape(alloc, steps.plan(StepShape((ReqSlice(2048, context, samples=False),))))
    return alloc.peak_allocated


def test_context_up_projection_grows_with_the_prefix_up_to_the_workspace() -> None:
    """Each pass up-projects `[piece, heads, (nope + v) + (nope + rope)]`, 14 KiB a context token;
    past the 64k workspace the piece stops growing. Below ~37k tokens of context it stays within
    the profile's stand-in, above it the step needs more than the profile saw."""
    r, rep = _boot()
    per_token = 16 * (256 + 192) * 2
    # (the caching allocator rounds each block up to 2 MiB segments)
    assert abs(_peak(r, 40000) - _peak(r, 8000) - 32000 * per_token) <= 2 * MiB
    # Past the workspace a second pass follows; its kv_b_proj output [following, 16, nope 128 + v
    # 128] x 2 B (the larger of it and its k) and its output are made while the first pass's are
    # bound (0.33.0 mla_attention.py:3043-3053); the overlap stops growing at a second full pass.
    overlap = (120000 - 65536) * 16 * 256 * 2 + 2048 * 16 * (128 * 2 + 4)
    assert abs(_peak(r, 120000) - _peak(r, 65536) - overlap) <= 2 * MiB
    assert _peak(r, 3 * 65536) == _peak(r, 2 * 65536)
    assert _peak(r, 8000) < rep.activation_peak < _peak(r, 65536)


def test_kvgate_never_charges_a_lone_long_prefill_less_than_the_simulator_plays() -> None:
    """kvgate's worst step of one long prompt (kvgate/memory/activation.py: hidden states + the MLA
    layer's own tensors and up-projections, or the MoE) against the simulator's independent tape of
    that step, 2,048 new tokens after `context` computed ones: never under it, and at most 5 %
    over (kvgate also counts vLLM's running context output, `init_mla_context_partial`, which a
    step allocates when other prefills share it, and ``kv_c_normed``)."""
    from kvgate.memory.activation import EngineShape, SamplingShape, estimate_transient
    from support.geometry import model_geometry

    r, _ = _boot()
    g = model_geometry("deepseek-v2-lite")
    e = EngineShape(131072, 2048, 256, attention_backend="mla", block_size=64, runner="v2")
    for context in (2048, 13952, 29952, 45952, 61952, 117952):
        est = estimate_transient(g, e, context + 2048, SamplingShape())
        forward = [t.bytes for t in est.terms if t.stage == "forward"]
        mla = sum(t.bytes for t in est.terms if t.name.startswith("mla_") and t.stage == "forward")
        kvgate = est.term("hidden_states").bytes + max(mla, *forward)
        sim = _peak(r, context)
        assert sim <= kvgate <= 1.05 * sim, (context, kvgate / MiB, sim / MiB)
