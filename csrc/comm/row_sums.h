// Sums of the rows an exchange receives. On the engine's own threads (the relay thread, the channel's worker) plain
// loops: an ATen kernel there starts an OpenMP team of its own beside the ranks' (a thread's intra-op count is not
// the caller's). They give the bits of ATen's `mine.add_(sum_rows(rows))`, which the caller's threads compute.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace zero_kernels::comm {

// mine += the rows, in order, summed first (their sum in the accumulation type, rounded to T, then added to mine),
// as ATen sums a floating-point tensor's rows and adds them: both give the same bits.
template <typename T>
void add_rows(T* mine, const std::vector<const T*>& rows, int64_t n) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  if (rows.size() == 1) {
    const T* row = rows.front();
    for (int64_t i = 0; i < n; ++i) {
      mine[i] = static_cast<T>(static_cast<Acc>(mine[i]) + static_cast<Acc>(row[i]));
    }
    return;
  }
  thread_local std::vector<Acc> sum;
  sum.assign(rows.front(), rows.front() + n);
  for (size_t r = 1; r < rows.size(); ++r) {
    const T* row = rows[r];
    for (int64_t i = 0; i < n; ++i) {
      sum[i] += static_cast<Acc>(row[i]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    mine[i] = static_cast<T>(static_cast<Acc>(mine[i]) + static_cast<Acc>(static_cast<T>(sum[i])));
  }
}

// The sum of `rows` over its first dimension, through ATen (one row is itself: nothing is copied).
inline at::Tensor sum_rows(const at::Tensor& rows) { return rows.size(0) == 1 ? rows.select(0, 0) : rows.sum(0); }

template <typename T>
void add_rows_of(const at::Tensor& mine, const at::Tensor& rows) {
  std::vector<const T*> pointers;
  for (int64_t r = 0; r < rows.size(0); ++r) {
    pointers.push_back(rows.select(0, r).const_data_ptr<T>());
  }
  add_rows(mine.data_ptr<T>(), pointers, mine.numel());
}

// mine += the sum of `rows` (at least one row; each contiguous, as long as `mine`, of its dtype): floating
// types in plain loops, other dtypes (not summed on the engine's threads by zero_kernels) through ATen.
inline void add_rows(const at::Tensor& mine, const at::Tensor& rows) {
  switch (mine.scalar_type()) {
    case at::kFloat:
      return add_rows_of<float>(mine, rows);
    case at::kDouble:
      return add_rows_of<double>(mine, rows);
    case at::kHalf:
      return add_rows_of<c10::Half>(mine, rows);
    case at::kBFloat16:
      return add_rows_of<c10::BFloat16>(mine, rows);
    default:
      mine.add_(sum_rows(rows));
  }
}

}  // namespace zero_kernels::comm
