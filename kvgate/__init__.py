"""kvgate: an admission-control sidecar that keeps vLLM from dying of CUDA out-of-memory."""
