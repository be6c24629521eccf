// The attention kernels for head_dim 64, every group size (attention_kernels.h says why
// they live one head_dim per file).
#include "attention_kernels.h"

namespace localllm_cpu::attention_detail {

AttendFn pick_attend_d64(int64_t g) { return pick_group<AttendFn, Fixed<64>::Range>(g, Groups{}); }
MultiFn pick_multi_d64(int64_t g) { return pick_group<MultiFn, Fixed<64>::Multi>(g, Groups{}); }

}  // namespace localllm_cpu::attention_detail
