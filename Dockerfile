# syntax=docker/dockerfile:1
# kvgate: the admission-control sidecar that sits in front of vLLM (same pod).
#
#   docker build -t kvgate:0.1.0 .
#   docker run --rm -e KVGATE_MODEL=/models/m -e KVGATE_BACKEND=http://vllm:8000 \
#       -v /path/to/model:/models/m:ro -p 8080:8080 kvgate:0.1.0
#
# Only kvgate's own dependencies go in (no torch, no vLLM): kvgate reads the model's
# config.json and tokenizer files, never its weights. Every `kvgate serve` flag is also a
# KVGATE_* environment variable, which is how Kubernetes configures it (deploy/kubernetes/).
# tests/integration/test_deploy_image.py runs this file's build-stage steps in a fresh venv.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a self-contained virtual environment in /opt/kvgate ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgate ./kvgate
RUN python -m venv /opt/kvgate \
 && /opt/kvgate/bin/pip install . \
 && /opt/kvgate/bin/kvgate serve --help > /dev/null

# ---- runtime: the venv, a non-root user, nothing else ----
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="Admission-control sidecar that keeps vLLM from dying of CUDA out-of-memory" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    KVGATE_LISTEN=0.0.0.0:8080
USER 10001:10001
EXPOSE 8080
# Liveness of the process only (/healthz); /readyz also needs the backend. No curl in the slim
# image, so the check is Python's urllib on the port KVGATE_LISTEN names.
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('KVGATE_LISTEN', '0.0.0.0:8080').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=2)"]
ENTRYPOINT ["kvgate", "serve"]
