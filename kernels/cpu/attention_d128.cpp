// The attention kernels for head_dim 128, every group size (attention_kernels.h says why
// they live one head_dim per file).
#include "attention_kernels.h"

namespace localllm_cpu::attention_detail {

AttendFn pick_attend_d128(int64_t g) { return pick_group<AttendFn, Fixed<128>::Range>(g, Groups{}); }
MultiFn pick_multi_d128(int64_t g) { return pick_group<MultiFn, Fixed<128>::Multi>(g, Groups{}); }

}  // namespace localllm_cpu::attention_detail
