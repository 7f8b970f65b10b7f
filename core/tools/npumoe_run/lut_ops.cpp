// npumoe's LUT kernels as ExecuTorch kernels: npumoe::lut_swiglu_experts.out and npumoe::swiglu_experts.out, a
// layer's routed SwiGLU experts over stacked packed or fp32 matrices, and npumoe::lut_linear_rows.out and
// npumoe::f32_linear_rows.out, one packed or fp32 linear (npumoe/luts/experts_op.py and linear_op.py define the ops
// for export and run the same C functions eagerly).
// The matrices are the program's constants, read where the loader put them (mapped pages), never copied.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <algorithm>
#include <cstdint>
#include <thread>

extern "C" {
typedef struct {
  const uint8_t* tiles;
  const uint16_t* scales;
  const uint8_t* zeros;
  int n, k, bits, group, experts;
} npumoe_lut_stack;
int npumoe_lut_swiglu_rows(const npumoe_lut_stack* gate, const npumoe_lut_stack* up, const npumoe_lut_stack* down,
                           const int64_t* ids, const float* weights, int rows, int k, const float* x, float* y,
                           int threads);
typedef struct {
  const float* f32;
  int n, k, experts;
} npumoe_f32_stack;
int npumoe_f32_swiglu_rows(const npumoe_f32_stack* gate, const npumoe_f32_stack* up, const npumoe_f32_stack* down,
                           const int64_t* ids, const float* weights, int rows, int k, const float* x, float* y,
                           int threads);
typedef struct {
  const uint8_t* tiles;
  const uint16_t* scales;
  const uint8_t* zeros;
  int row_blocks, k, bits, group;
} lut_weight;
void npumoe_f32_linear_rows(const float* w, int n, int k, const float* x, int rows, float* y, int threads);
int npumoe_lut_linear(const lut_weight* w, const float* x, int m, int valid, float* y, int int8_from,
                      int dequant_from, int threads);
}

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

npumoe_lut_stack stack(const Tensor& tiles, const Tensor& scales, const Tensor& zeros, int64_t n, int64_t k,
                       int64_t bits, int64_t group) {
  return {tiles.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.const_data_ptr()),
          zeros.numel() ? zeros.const_data_ptr<uint8_t>() : nullptr, static_cast<int>(n), static_cast<int>(k),
          static_cast<int>(bits), static_cast<int>(group), static_cast<int>(tiles.size(0))};
}

int threads() {
  static const int count = [] {
    const char* env = std::getenv("NPUMOE_THREADS");
    const int asked = env ? std::atoi(env) : 0;
    return asked > 0 ? asked : std::max(1u, std::thread::hardware_concurrency());
  }();
  return count;
}

Tensor& lut_swiglu_experts_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& ids, const Tensor& weights,
                               const Tensor& gate_tiles, const Tensor& gate_scales, const Tensor& gate_zeros,
                               const Tensor& up_tiles, const Tensor& up_scales, const Tensor& up_zeros,
                               const Tensor& down_tiles, const Tensor& down_scales, const Tensor& down_zeros,
                               int64_t bits, int64_t group, int64_t inter, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  x.dim() == 2 && ids.dim() == 2 && x.scalar_type() == ScalarType::Float &&
                      ids.scalar_type() == ScalarType::Long && weights.scalar_type() == ScalarType::Float &&
                      out.scalar_type() == ScalarType::Float && out.numel() == x.numel() &&
                      ids.size(0) == x.size(0) && weights.numel() == ids.numel() &&
                      gate_scales.scalar_type() == ScalarType::Half,
                  InvalidArgument, out);
  const int64_t hidden = x.size(1);
  const npumoe_lut_stack gate = stack(gate_tiles, gate_scales, gate_zeros, inter, hidden, bits, group);
  const npumoe_lut_stack up = stack(up_tiles, up_scales, up_zeros, inter, hidden, bits, group);
  const npumoe_lut_stack down = stack(down_tiles, down_scales, down_zeros, hidden, inter, bits, group);
  const int status = npumoe_lut_swiglu_rows(&gate, &up, &down, ids.const_data_ptr<int64_t>(),
                                            weights.const_data_ptr<float>(), static_cast<int>(x.size(0)),
                                            static_cast<int>(ids.size(1)), x.const_data_ptr<float>(),
                                            out.mutable_data_ptr<float>(), threads());
  ET_KERNEL_CHECK_MSG(ctx, status == 0, InvalidArgument, out, "npumoe::lut_swiglu_experts failed (%d)", status);
  return out;
}

npumoe_f32_stack f32_stack(const Tensor& t) {
  return {t.const_data_ptr<float>(), static_cast<int>(t.size(1)), static_cast<int>(t.size(2)),
          static_cast<int>(t.size(0))};
}

Tensor& swiglu_experts_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& ids, const Tensor& weights,
                           const Tensor& gate, const Tensor& up, const Tensor& down, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  x.dim() == 2 && ids.dim() == 2 && x.scalar_type() == ScalarType::Float &&
                      ids.scalar_type() == ScalarType::Long && weights.scalar_type() == ScalarType::Float &&
                      out.scalar_type() == ScalarType::Float && out.numel() == x.numel() &&
                      ids.size(0) == x.size(0) && weights.numel() == ids.numel() && gate.dim() == 3 &&
                      up.dim() == 3 && down.dim() == 3 && gate.scalar_type() == ScalarType::Float &&
                      up.scalar_type() == ScalarType::Float && down.scalar_type() == ScalarType::Float &&
                      gate.size(2) == x.size(1) && down.size(1) == x.size(1),
                  InvalidArgument, out);
  const npumoe_f32_stack g = f32_stack(gate), u = f32_stack(up), d = f32_stack(down);
  const int status = npumoe_f32_swiglu_rows(&g, &u, &d, ids.const_data_ptr<int64_t>(), weights.const_data_ptr<float>(),
                                            static_cast<int>(x.size(0)), static_cast<int>(ids.size(1)),
                                            x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), threads());
  ET_KERNEL_CHECK_MSG(ctx, status == 0, InvalidArgument, out, "npumoe::swiglu_experts failed (%d)", status);
  return out;
}

// The first valid[0] rows of x (a prefill chunk's real rows; the padding's outputs are zero) by the path the engine
// takes for the whole chunk (npumoe_lut_linear).
Tensor& lut_linear_rows_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& valid, const Tensor& tiles,
                            const Tensor& scales, const Tensor& zeros, int64_t bits, int64_t group,
                            int64_t out_features, int64_t int8_from, int64_t dequant_from, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  x.dim() == 2 && tiles.dim() == 4 && x.scalar_type() == ScalarType::Float &&
                      out.scalar_type() == ScalarType::Float && scales.scalar_type() == ScalarType::Half &&
                      tiles.size(0) * 16 == out_features && x.size(1) == tiles.size(1) * 32 && tiles.size(2) == bits &&
                      out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == out_features &&
                      valid.scalar_type() == ScalarType::Long && valid.numel() == 1,
                  InvalidArgument, out);
  const lut_weight w = {tiles.const_data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.const_data_ptr()),
                        zeros.numel() ? zeros.const_data_ptr<uint8_t>() : nullptr, static_cast<int>(tiles.size(0)),
                        static_cast<int>(x.size(1)), static_cast<int>(bits), static_cast<int>(group)};
  const int status =
      npumoe_lut_linear(&w, x.const_data_ptr<float>(), static_cast<int>(x.size(0)),
                        static_cast<int>(valid.const_data_ptr<int64_t>()[0]), out.mutable_data_ptr<float>(),
                        static_cast<int>(int8_from), static_cast<int>(dequant_from), threads());
  ET_KERNEL_CHECK_MSG(ctx, status == 0, MemoryAllocationFailed, out, "npumoe::lut_linear_rows failed (%d)", status);
  return out;
}

Tensor& f32_linear_rows_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.scalar_type() == ScalarType::Float &&
                      w.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float &&
                      x.size(1) == w.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0),
                  InvalidArgument, out);
  npumoe_f32_linear_rows(w.const_data_ptr<float>(), static_cast<int>(w.size(0)), static_cast<int>(w.size(1)),
                         x.const_data_ptr<float>(), static_cast<int>(x.size(0)), out.mutable_data_ptr<float>(),
                         threads());
  return out;
}

}  // namespace

EXECUTORCH_LIBRARY(npumoe, "lut_swiglu_experts.out", lut_swiglu_experts_out);
EXECUTORCH_LIBRARY(npumoe, "swiglu_experts.out", swiglu_experts_out);
EXECUTORCH_LIBRARY(npumoe, "lut_linear_rows.out", lut_linear_rows_out);
EXECUTORCH_LIBRARY(npumoe, "f32_linear_rows.out", f32_linear_rows_out);
