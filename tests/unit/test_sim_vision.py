"""The simulator's encoder step (kvgate/sim/vision.py): images counted by its own reading of
Qwen2.5-VL's processor, a burst of photos out of memory where Model Runner V2's start-up profile
ran no encoder (vLLM 0.25.0) and served where it did (0.32.0)."""

from __future__ import annotations

import pytest
from sim_support import Job, make_engine, play

from bench.workloads import png_data_url
from demo.replay import fully_utilized
from kvgate.sim.api import SimApiError, parse
from kvgate.sim.config import SimConfig
from kvgate.sim.gpu import CachingAllocator, Device
from kvgate.sim.model import load_model
from kvgate.sim.request import Sampling
from kvgate.sim.tokens import StandInTokenizer
from kvgate.sim.vision import IMAGE_PAD, EncoderCache
from kvgate.units import GiB

SHORT = Sampling(max_tokens=8)
VL = load_model("qwen2.5-vl-7b")


def _engine_config(version: str) -> SimConfig:
    return fully_utilized(
        SimConfig(
            model="qwen2.5-vl-7b",
            vllm_version=version,
            max_model_len=32768,
            max_num_batched_tokens=8192,
            max_num_seqs=256,
        )
    )


def image_part(width: int, height: int, color: tuple[int, int, int]) -> dict:
    return {"type": "image_url", "image_url": {"url": png_data_url(width, height, color)}}


@pytest.mark.parametrize(("width", "height", "tokens"), [(640, 480, 391), (1344, 1008, 1728), (2016, 1512, 3888)])
def test_image_tokens_follow_smart_resize(width: int, height: int, tokens: int) -> None:
    assert VL.vision is not None
    assert VL.vision.embeddings(width, height) == tokens
    assert VL.vision.max_embeddings == 12845056 // 28**2


def test_a_chat_image_becomes_its_tokens_and_a_text_model_refuses_it() -> None:
    assert VL.vision is not None
    tok = StandInTokenizer(VL.vocab, {IMAGE_PAD: VL.vision.image_token_id})
    body = {
        "messages": [
            {"role": "user", "content": [image_part(640, 480, (1, 2, 3)), {"type": "text", "text": "what is it?"}]}
        ]
    }
    text_only = parse(
        {"messages": [{"role": "user", "content": "what is it?"}]}, chat=True, tok=tok, served="m", max_model_len=32768
    )
    p = parse(dict(body), chat=True, tok=tok, served="m", max_model_len=32768, vision=VL.vision)
    assert [(i.length) for i in p.prompts[0].mm_items] == [391]
    start = p.prompts[0].mm_items[0].start
    image = p.prompts[0].token_ids[start : start + 391]
    assert len(set(image)) == 1  # one stand-in id per image: its blocks hash apart from another image's
    assert image[0] < 0
    other = parse(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{**image_part(640, 480, (9, 9, 9))}, {"type": "text", "text": "what is it?"}],
                }
            ]
        },
        chat=True,
        tok=tok,
        served="m",
        max_model_len=32768,
        vision=VL.vision,
    )
    assert other.prompts[0].token_ids[start] != image[0]
    assert (
        len(p.prompts[0].token_ids)
        == len(text_only.prompts[0].token_ids)
        + len(tok.encode("<|vision_start|><|image_pad|><|vision_end|>", False))
        - 1
        + 391
    )
    with pytest.raises(SimApiError, match="does not take images"):
        parse(dict(body), chat=True, tok=tok, served="m", max_model_len=32768)


def test_an_image_burst_runs_v2_out_of_memory_without_an_encoder_profile() -> None:
    """24 requests with a 2,016 x 1,512 photo (3,888 image tokens) each: a step encodes the photos
    of the two requests its 8,192 tokens hold and of the third its chunk reaches, on a pool sized
    by vLLM's own advice from a profile that ran no encoder (0.25.0's V2)."""
    burst = [Job(3988, SHORT, count=24, image=3888)]
    outcome = play(_engine_config("0.25.0"), burst)
    assert outcome.oom is not None
    assert "CUDA out of memory" in outcome.oom
    alone = play(_engine_config("0.25.0"), [Job(3988, SHORT, count=1, image=3888)])
    assert alone.oom is None
    assert sum(alone.finished.values()) == 1
    served = play(_engine_config("0.32.0"), burst)  # V2 profiles the encoder from 0.28.0
    assert served.oom is None
    assert sum(served.finished.values()) == 24


def test_the_profile_holds_the_encoders_largest_step() -> None:
    old, new = (
        make_engine(SimConfig(model="qwen2.5-vl-7b", vllm_version=v, max_model_len=32768)).report
        for v in ("0.25.0", "0.32.0")
    )
    assert new.activation_peak > old.activation_peak
    assert new.kv_available < old.kv_available


def test_freeable_entries_stay_until_their_room_is_needed() -> None:
    alloc = CachingAllocator(Device(GiB), "p")
    cache = EncoderCache(alloc, size=100)
    cache.add(("a", 0), 60, alloc.malloc(60 << 10))
    cache.release(("a", 0))
    assert cache.has(("a", 0))
    assert alloc.allocated() == 60 << 10
    assert cache.room_for(60, reserved=0)
    cache.make_room(60)
    assert not cache.has(("a", 0))
    assert alloc.allocated() == 0


def test_with_videos_allowed_vllm_budgets_and_profiles_a_video() -> None:
    """vLLM's default allows videos, and its largest video (qwen2_vl.py `get_max_video_tokens`:
    frames of the 16,384-embedding largest image at the image processor's pixels, as many as
    max_model_len holds, 1 to 14, two a temporal patch) outweighs the image once 3 frames fit: B is
    that video's, and the profile encodes the dummy video (`get_modality_with_max_tokens`, a tie
    to video), which the video processor resizes (here the preset's preprocessor_config.json's
    pixel range; 602,112 pixels a frame: 3,584 x 3,584 down to 756 x 756, 729 embeddings)."""
    from dataclasses import replace

    from kvgate.sim.vision import encoder_budget, profile_items

    tower = VL.vision
    assert tower is not None
    assert tower.largest_video(8192) == (16384, 16384)  # one frame: the image's count, video wins the tie
    assert tower.largest_video(32768) == (2 * 16384, 2 * 16384)  # 4 frames
    assert tower.largest_video(1 << 20)[0] == 7 * 16384  # at most 14 frames
    assert encoder_budget(tower, 8192, 32768) == 32768
    assert profile_items(tower, 8192, 256, 32768) == [32768]
    small = replace(tower, video_max_pixels=602112)
    assert small.largest_video(32768) == (32768, 2 * 729)
    assert profile_items(small, 8192, 256, 32768) == [2 * 729]
