"""kvgate: an admission-control sidecar that keeps vLLM from dying of CUDA out-of-memory."""

from kvgate.logs import silence_torch_absence

silence_torch_absence()
