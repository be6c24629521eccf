// The attention kernel for a head_dim without a fixed-size form, every group size
// (attention_kernels.h says why it lives in a file of its own).
#include "attention_kernels.h"

namespace localllm_cpu::attention_detail {

AttendFn pick_attend_generic(int64_t g) { return pick_group<AttendFn, Generic>(g, Groups{}); }

}  // namespace localllm_cpu::attention_detail
