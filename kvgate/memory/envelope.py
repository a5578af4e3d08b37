"""Device memory vLLM holds outside its ``gpu_memory_utilization`` envelope.

vLLM 0.32.0 ``v1/worker/gpu_worker.py`` ``Worker.init_device`` sets the device, runs
``init_worker_distributed_environment`` ("Initialize the distributed environment BEFORE taking
memory snapshot ... NCCL buffers are allocated before we measure"), and only then takes
``MemorySnapshot``; ``v1/worker/utils.py`` ``request_memory`` asks for ``total x utilization``
and ``determine_available_memory`` measures everything else (weights, the profile's peak, its
non-torch increase) from that snapshot. So the process's CUDA context and, at tensor
parallelism > 1, the communicators' buffers come on top of ``total x utilization``: the memory
left for what the profile never saw is ``total x (1 - utilization)`` minus them.

The same order was read in the wheels of 0.12.0, 0.21.0 and 0.31.0. Older releases differ:
vLLM 0.10.1.1 ``v1/worker/gpu_worker.py`` takes its snapshot (``init_snapshot``) before
``init_worker_distributed_environment``, so the communicators' buffers count as the profile's
non-torch increase, inside the envelope; only the CUDA context is outside (since 0.7, vLLM PR
#12126). Before 0.7 (PR #10511's logs) the baseline preceded CUDA initialisation and nothing was
outside.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from kvgate.units import GiB, MiB

# The CUDA context of one process (driver state, lazily loaded kernels, cuBLAS handles) is not
# readable from vLLM's code. PyTorch's ptrblck put it at "~300MB" with CUDA >= 11.7's lazy module
# loading (pytorch/pytorch#107667); vLLM PR #10511's H100 log (non_torch_memory 1.79 GiB, the
# context included) against PR #12126's (0.16 GiB without it) bounds context + kernels at 1.6 GiB.
# kvgate takes 500 MiB, above the first figure (set --cuda-context-bytes to your measurement:
# nvidia-smi's process memory minus vLLM's "Memory profiling" total).
CUDA_CONTEXT_BYTES = 500 * MiB

# vllm 0.32.0 distributed/device_communicators/custom_all_reduce.py CustomAllreduce.__init__:
# max_size=8192 * 1024 (lowered per GPU by CUSTOM_ALL_REDUCE_MAX_SIZES when symmetric memory is
# on; kvgate keeps the default, the larger), _DEFAULT_ALL_GATHER_MAX_SIZE 2 MiB,
# _DEFAULT_REDUCE_SCATTER_MAX_SIZE 16 MiB, rank_data 8 MiB; ops.meta_size() (the C++ Signal
# struct, a few KiB) is counted as 1 MiB.
CUSTOM_AR_MAX_SIZE = 8 * MiB
CUSTOM_AR_ALL_GATHER_MAX_SIZE = 2 * MiB
CUSTOM_AR_REDUCE_SCATTER_MAX_SIZE = 16 * MiB
CUSTOM_AR_RANK_DATA = 8 * MiB
CUSTOM_AR_META_ALLOWANCE = 1 * MiB
CUSTOM_AR_WORLD_SIZES = (2, 4, 6, 8, 16)  # CustomAllreduce._SUPPORTED_WORLD_SIZES
# _init_mnnvl_buffer: 6 x max(all-gather size x world size, 16 MiB reduce-scatter), kept where the
# symmetric-memory handle has a multicast pointer (NVSwitch); counted always (cautious).
MNNVL_ALL_GATHER_MAX_SIZES = {2: 8 * MiB, 4: 4 * MiB, 6: 2 * MiB, 8: 2 * MiB, 16: 2 * MiB}
MNNVL_STAGES = 6
# distributed/device_communicators/all_reduce_utils.py SYMM_MEM_ALL_REDUCE_MAX_SIZES: the
# SymmMemCommunicator buffer (VLLM_ALLREDUCE_USE_SYMM_MEM on by default), per world size; the
# table is per GPU generation and kvgate does not know the GPU: the largest over 9.0, 10.0, 10.3.
SYMM_MEM_MAX_SIZES = {2: 64 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB}
# NCCL's own communicator buffers (PyNcclCommunicator and torch's NCCL group) are sized inside
# NCCL (NCCL_BUFFSIZE per channel and peer), not in vLLM's code: an assumption, no public figure.
NCCL_COMMUNICATOR_BYTES = 128 * MiB
# vLLM's "non-torch forward increase memory" (cuBLAS workspaces and kernels the profile loads):
# inside the envelope with gpu_memory_utilization, but it comes off the GPU's rest under
# --kv-cache-memory-bytes. vLLM PR #12126's H100 log: "non_torch_memory takes 0.16GiB" (TP 1).
NON_TORCH_INCREASE_BYTES = int(0.16 * GiB)

# The first release whose gpu_worker.py takes the snapshot after the distributed set-up. Read:
# 0.10.1.1 (before); 0.12.0, 0.21.0, 0.31.0, 0.32.0 (after). 0.11.x was not read: kvgate counts
# the buffers outside from 0.11.0 on (cautious).
COMMUNICATORS_OUTSIDE_SINCE = "0.11.0"


def custom_all_reduce_bytes(world_size: int) -> int:
    """One rank's custom all-reduce buffers (vLLM 0.32.0 ``CustomAllreduce.__init__``)."""
    if world_size not in CUSTOM_AR_WORLD_SIZES:
        return 0  # vLLM disables it ("unsupported world size")
    meta = CUSTOM_AR_META_ALLOWANCE + CUSTOM_AR_MAX_SIZE
    legacy = max(CUSTOM_AR_MAX_SIZE, CUSTOM_AR_ALL_GATHER_MAX_SIZE, CUSTOM_AR_REDUCE_SCATTER_MAX_SIZE)
    mnnvl = MNNVL_STAGES * max(MNNVL_ALL_GATHER_MAX_SIZES[world_size] * world_size, CUSTOM_AR_REDUCE_SCATTER_MAX_SIZE)
    return meta + legacy + CUSTOM_AR_RANK_DATA + mnnvl


def communication_bytes(tensor_parallel_size: int) -> int:
    """One rank's communicator buffers at this tensor parallelism (0 at TP 1)."""
    if tensor_parallel_size <= 1:
        return 0
    symm_mem = SYMM_MEM_MAX_SIZES.get(tensor_parallel_size, 0)
    return NCCL_COMMUNICATOR_BYTES + symm_mem + custom_all_reduce_bytes(tensor_parallel_size)


@dataclass(frozen=True)
class OutsideEnvelope:
    """What one GPU holds beyond ``total x gpu_memory_utilization``."""

    cuda_context: int
    communication: int

    @property
    def total(self) -> int:
        return self.cuda_context + self.communication

    def describe(self) -> str:
        text = f"CUDA context {self.cuda_context / MiB:.0f} MiB"
        if self.communication:
            text += f" + communicator buffers {self.communication / MiB:.0f} MiB"
        return text


def outside_envelope(
    tensor_parallel_size: int, cuda_context_bytes: int = CUDA_CONTEXT_BYTES, vllm_version: str | None = None
) -> OutsideEnvelope:
    """The CUDA context, and the communicators where this vLLM allocates them before its snapshot."""
    older = vllm_version is not None and _older_than(vllm_version, COMMUNICATORS_OUTSIDE_SINCE)
    comm = 0 if older else communication_bytes(tensor_parallel_size)
    return OutsideEnvelope(cuda_context_bytes, comm)


def _older_than(version: str, than: str) -> bool:
    try:
        return Version(version) < Version(than)
    except ValueError:
        return False
