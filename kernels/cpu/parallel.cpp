// parallel.h's forwarding to torch: the one kernel-side file that parses ATen's headers.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace localllm_cpu {

void parallel_for_ranges(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(f, b, e); });
}

int64_t num_threads() { return at::get_num_threads(); }

void fail(const std::string& message) { TORCH_CHECK(false, message); }

}  // namespace localllm_cpu
