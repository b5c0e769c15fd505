"""The native side: building and loading the libraries in `kernels/`, and checking them on a GPU.

* `build`: compiles the host (g++) and CUDA (nvcc) libraries on first use into a per-user cache; no torch.
* `ops`: the `wna16ctl::*` torch ops over those libraries (repack, MoE GEMM), CPU or CUDA.
* `gpucheck`: the one unattended GPU check (`scripts/gpu_check.sh`).

Never required: without a compiler every command runs on the torch path.
"""
