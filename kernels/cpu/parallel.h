// The kernels' side of torch's thread pool and errors, with no torch header: parsing
// <ATen/Parallel.h> and <c10/util/Exception.h> cost each kernel file ~0.3 s of its cold build
// (kernels/cpu_ops.py). parallel.cpp, the one file that includes them, forwards to
// at::parallel_for (so the chunks each thread gets are exactly at::parallel_for's) and
// throws c10::Error (a RuntimeError in Python, as TORCH_CHECK's).
#pragma once

#include <cstdint>
#include <string>

namespace localllm_cpu {

using RangeFn = void (*)(const void* f, int64_t begin, int64_t end);

// at::parallel_for(begin, end, grain, [&](b, e) { fn(f, b, e); })
void parallel_for_ranges(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* f);

// at::parallel_for with f's body compiled here (in the kernel's file, with its flags); only
// the call per thread's range goes through a pointer.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_for_ranges(begin, end, grain,
                      [](const void* g, int64_t b, int64_t e) { (*static_cast<const F*>(g))(b, e); }, &f);
}

// at::get_num_threads()
int64_t num_threads();

// Throws c10::Error(message), as TORCH_CHECK(false, message) does.
[[noreturn]] void fail(const std::string& message);

namespace detail {
inline void append(std::string& s, const char* part) { s += part; }
inline void append(std::string& s, const std::string& part) { s += part; }
template <class T>
inline void append(std::string& s, T part) { s += std::to_string(part); }
template <class... Parts>
[[noreturn]] __attribute__((noinline, cold)) void fail_with(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  fail(s);
}
}  // namespace detail

}  // namespace localllm_cpu

// TORCH_CHECK for the kernel files: the message parts (strings and integers) are joined only
// when cond is false.
#define LOCALLLM_CHECK(cond, ...) \
  do { \
    if (__builtin_expect(!(cond), 0)) ::localllm_cpu::detail::fail_with(__VA_ARGS__); \
  } while (0)
