// Pinning the OpenMP team's threads to CPUs (kernels/cpu_ops.py's bind_threads says why).
#pragma once

#include <cstdint>
#include <vector>

namespace localllm_cpu {

// Binds thread i of the calling thread's OpenMP team to CPU cpus[i]; returns, per team thread,
// the one CPU its affinity now allows (-1: not bound to exactly one).
std::vector<int64_t> bind_threads(const int64_t* cpus, int64_t n);

}  // namespace localllm_cpu
