// Thread binding (threads.h). Only a thread can bind itself through this API, and the team's
// threads are reachable only inside a parallel region: hence the region. Teams belong to the
// thread that opens them, so each thread that runs the forward binds its own. Each index of a
// region over get_num_threads() items with grain 1 runs on its own team thread, the same
// thread in every later region of that size.
#include "threads.h"

#ifdef __linux__
#include <sched.h>
#endif

#include "common.h"

namespace localllm_cpu {

std::vector<int64_t> bind_threads(const int64_t* cpus, int64_t count) {
  const int64_t n = std::min<int64_t>(count, num_threads());
  std::vector<int64_t> bound(std::max<int64_t>(n, 0), -1);
#ifdef __linux__
  parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) continue;
      cpu_set_t want;
      CPU_ZERO(&want);
      CPU_SET(static_cast<int>(cpus[i]), &want);
      cpu_set_t now;
      // skip the call when already bound: re-binding every step costs nothing then
      if (sched_getaffinity(0, sizeof(now), &now) != 0 || !CPU_EQUAL(&now, &want))
        sched_setaffinity(0, sizeof(want), &want);
      if (sched_getaffinity(0, sizeof(now), &now) == 0 && CPU_EQUAL(&now, &want)) bound[i] = cpus[i];
    }
  });
#endif
  return bound;
}

}  // namespace localllm_cpu
