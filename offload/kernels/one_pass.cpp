// Adam, AdamW or SGD over float32 host tensors that writes each parameter's compute-dtype shadow
// (bfloat16 or float16) from the value it has just stored, in the same pass: the masters are read
// once a step instead of twice (Note: [One-pass update] in offload/kernels/one_pass.py).
//
// Bit-identical to torch.optim's fused CPU kernel: built with the flags of the CPU capability
// PyTorch dispatches to on this machine, over PyTorch's own vector type, each element goes
// through the same operations in the same order (the moment's lerp as one fused multiply-add, as
// PyTorch writes it). It covers each tensor's whole vectors only; the few elements after the last
// whole vector go through PyTorch's own kernel (one_pass.py), where its scalar loop handles them.
// offload/kernels/build.py compares the two on this machine before first use.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

struct Hyper {
  Vec beta2, one_minus_beta2, lerp_coeff, decay, minus_step_size, bc2_sqrt, eps, scale, clip;
  bool lerp_small, clipping;
};

// The gradient as the update reads it: a clip's coefficient applied first, as
// clip_grads_with_norm_'s grad.mul_(coefficient) leaves it, then GradScaler's scale divided out,
// as PyTorch's fused kernel does; stored back when either changed it, as both leave it.
template <bool SCALE, typename H>
inline Vec read_gradient(float* grad, int64_t d, const H& h) {
  Vec g = Vec::loadu(grad + d);
  if (h.clipping) g = g * h.clip;  // the same for every element of a call: a branch the CPU predicts
  if constexpr (SCALE) g = g / h.scale;
  if (SCALE || h.clipping) g.store(grad + d);
  return g;
}

// One vector of elements at `d`: the update; returns the parameters as stored.
template <bool AMSGRAD, bool MAXIMIZE, int DECAY, bool SCALE>
inline Vec adam_vector(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                       int64_t d, const Hyper& h) {
  Vec p = Vec::loadu(param + d);
  Vec g = read_gradient<SCALE>(grad, d, h);
  if constexpr (MAXIMIZE) g = g * Vec(-1.0f);
  if constexpr (DECAY == 1) {  // Adam: L2 penalty on the gradient
    g += p * h.decay;
  } else if constexpr (DECAY == 2) {  // AdamW: decoupled; h.decay is 1 - lr * weight_decay
    p = p * h.decay;
  }
  Vec m = Vec::loadu(exp_avg + d);
  // exp_avg.lerp_(grad, 1 - beta1), from the nearer end as torch.lerp computes it.
  const Vec coeff = h.lerp_small ? h.lerp_coeff : h.lerp_coeff - Vec(1.0f);
  const Vec base = h.lerp_small ? m : g;
  m = at::vec::fmadd(coeff, g - m, base);
  Vec v = Vec::loadu(exp_avg_sq + d) * h.beta2 + h.one_minus_beta2 * g * g;
  m.store(exp_avg + d);
  v.store(exp_avg_sq + d);
  Vec second = v;
  if constexpr (AMSGRAD) {
    second = at::vec::maximum(Vec::loadu(max_exp_avg_sq + d), v);
    second.store(max_exp_avg_sq + d);
  }
  const Vec denom = (second.sqrt() / h.bc2_sqrt) + h.eps;
  p = p + h.minus_step_size * m / denom;
  p.store(param + d);
  return p;
}

// Stores a whole low-precision vector past the caches when it is aligned: the shadow is read
// next by the copy to the device, so reading its lines in first (as a plain store does) only
// doubles its traffic.
template <typename Low>
inline void store_streaming(const at::vec::Vectorized<Low>& value, Low* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if ((reinterpret_cast<uintptr_t>(out) & 63) == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out), static_cast<__m512i>(value));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if ((reinterpret_cast<uintptr_t>(out) & 31) == 0) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out), static_cast<__m256i>(value));
    return;
  }
#endif
  value.store(out);
}

// Streaming stores are weakly ordered: each thread fences its own before the threads join.
inline void fence_streaming() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// at::parallel_for but for the first call on a thread. at::internal::lazy_init_num_threads is
// inline, so this extension has a thread-local "initialised" flag of its own beside PyTorch's,
// and at::parallel_for's first call on a thread here would set that thread's thread count to the
// last count torch.set_num_threads stored from any thread (another worker's, say): the caller's
// later PyTorch kernels would run on it, and a reduction's order, and so its result, can change
// with it. at::get_num_threads initialises the thread through PyTorch's own flag, as its kernels do.
template <typename F>
void parallel_runs(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end - begin > grain && !at::in_parallel_region() && at::get_num_threads() > 1) {
    at::internal::invoke_parallel(begin, end, grain, f);
  } else if (begin < end) {
    f(begin, end);
  }
}

// Runs `one(k)` (the update of vector k, returning the parameters as stored) over `vectors`
// vectors, a pair at a time so that a pair's shadow is one whole low-precision vector, stored at
// once. Work goes to the threads in runs of pairs: an element's result does not depend on its run.
// Runs of 64 pairs (2 K float32 elements with 512-bit vectors) let every thread take a share of a
// slice's smaller tensors: with 1 K pairs a 256 K-element tensor was 8 runs, and 16 threads
// updated at 0.65 of PyTorch's fused AdamW's rate (an H200 host, 2026-11-28).
template <typename Shadow, typename One>
void pairs_with_shadow(int64_t vectors, Shadow* out, const One& one) {
  constexpr int64_t kGrain = 64;
  parallel_runs(0, vectors / 2, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const Vec first = one(2 * pair);
      const Vec second = one(2 * pair + 1);
      if constexpr (!std::is_same_v<Shadow, float>) {
        store_streaming(at::vec::convert_from_float<Shadow>(first, second), out + 2 * pair * Vec::size());
      }
    }
    fence_streaming();
  });
  if (vectors % 2) {
    const Vec last = one(vectors - 1);
    if constexpr (!std::is_same_v<Shadow, float>) {
      at::vec::convert_from_float<Shadow>(last, last).store(out + (vectors - 1) * Vec::size(), Vec::size());
    }
  }
}

template <bool AMSGRAD, bool MAXIMIZE, int DECAY, bool SCALE, typename Shadow>
void adam_tensor(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, void* shadow,
                 int64_t vectors, const Hyper& h) {
  const Hyper local = h;  // a copy the loop keeps in registers
  auto one = [=](int64_t k) {
    return adam_vector<AMSGRAD, MAXIMIZE, DECAY, SCALE>(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                                        k * Vec::size(), local);
  };
  pairs_with_shadow(vectors, static_cast<Shadow*>(shadow), one);
}

using TensorFn = void (*)(float*, float*, float*, float*, float*, void*, int64_t, const Hyper&);

// The instance of adam_tensor for these flags (each a template argument, so the loop has no branch).
template <bool AMSGRAD, bool MAXIMIZE, int DECAY, bool SCALE>
TensorFn pick_shadow(at::ScalarType shadow) {
  if (shadow == at::kBFloat16) return &adam_tensor<AMSGRAD, MAXIMIZE, DECAY, SCALE, c10::BFloat16>;
  if (shadow == at::kHalf) return &adam_tensor<AMSGRAD, MAXIMIZE, DECAY, SCALE, c10::Half>;
  return &adam_tensor<AMSGRAD, MAXIMIZE, DECAY, SCALE, float>;  // float: no shadow
}

template <bool AMSGRAD, bool MAXIMIZE, int DECAY>
TensorFn pick_scale(bool scale, at::ScalarType shadow) {
  return scale ? pick_shadow<AMSGRAD, MAXIMIZE, DECAY, true>(shadow)
               : pick_shadow<AMSGRAD, MAXIMIZE, DECAY, false>(shadow);
}

template <bool AMSGRAD, bool MAXIMIZE>
TensorFn pick_decay(int decay, bool scale, at::ScalarType shadow) {
  if (decay == 1) return pick_scale<AMSGRAD, MAXIMIZE, 1>(scale, shadow);
  if (decay == 2) return pick_scale<AMSGRAD, MAXIMIZE, 2>(scale, shadow);
  return pick_scale<AMSGRAD, MAXIMIZE, 0>(scale, shadow);
}

TensorFn pick(bool amsgrad, bool maximize, int decay, bool scale, at::ScalarType shadow) {
  if (amsgrad) {
    return maximize ? pick_decay<true, true>(decay, scale, shadow) : pick_decay<true, false>(decay, scale, shadow);
  }
  return maximize ? pick_decay<false, true>(decay, scale, shadow) : pick_decay<false, false>(decay, scale, shadow);
}

void check_state(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              what, ": contiguous float32 CPU tensors of the parameter's size expected");
}

at::ScalarType shadow_kind(const at::Tensor& shadow, int64_t numel) {
  if (shadow.numel() == 0) return at::kFloat;
  const at::ScalarType kind = shadow.scalar_type();
  TORCH_CHECK((kind == at::kBFloat16 || kind == at::kHalf) && shadow.numel() == numel && shadow.is_contiguous(),
              "a shadow is a contiguous bfloat16 or float16 tensor of its parameter's size");
  return kind;
}

}  // namespace

// The number of float32 elements one vector holds: the kernel covers each tensor's first
// numel - numel % vector_size() elements.
int64_t vector_size() { return Vec::size(); }

// Adam (adamw=false) or AdamW over the whole vectors of each tensor, writing shadows[k] (bfloat16
// or float16; an empty tensor for none) from params[k] as updated. steps[k] holds the step count
// after its increment, as torch.optim hands it to its fused kernel. With `clip`, each gradient is
// first multiplied by it and stored so (a clip's scaling done as the update reads the gradient).
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
               const std::vector<at::Tensor>& shadows, double lr, double beta1, double beta2, double weight_decay,
               double eps, bool amsgrad, bool maximize, bool adamw, const c10::optional<at::Tensor>& grad_scale,
               const c10::optional<double>& clip) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  shadows.size() == n && (!amsgrad || max_exp_avg_sqs.size() == n),
              "adam_step: lists of different lengths");
  const int decay = weight_decay == 0.0 ? 0 : (adamw ? 2 : 1);
  Hyper h;
  h.scale = Vec(grad_scale.has_value() ? grad_scale->item<float>() : 1.0f);
  h.clipping = clip.has_value();
  h.clip = Vec(float(clip.value_or(1.0)));
  h.beta2 = Vec(float(beta2));
  h.one_minus_beta2 = Vec(float(1 - beta2));
  h.lerp_coeff = Vec(float(1 - beta1));
  h.lerp_small = std::abs(float(1 - beta1)) < 0.5f;
  h.decay = Vec(decay == 2 ? float(1 - lr * weight_decay) : float(weight_decay));
  h.eps = Vec(float(eps));
  for (size_t k = 0; k < n; ++k) {
    const int64_t numel = params[k].numel();
    check_state(params[k], numel, "parameters");
    check_state(grads[k], numel, "gradients");
    check_state(exp_avgs[k], numel, "exp_avg");
    check_state(exp_avg_sqs[k], numel, "exp_avg_sq");
    float* max_sq = nullptr;
    if (amsgrad) {
      check_state(max_exp_avg_sqs[k], numel, "max_exp_avg_sq");
      max_sq = max_exp_avg_sqs[k].data_ptr<float>();
    }
    const at::ScalarType kind = shadow_kind(shadows[k], numel);
    void* shadow = kind == at::kFloat ? nullptr : shadows[k].data_ptr();
    // As the reference: the step read as float, the bias corrections in double.
    const double step = steps[k].item<float>();
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    h.minus_step_size = Vec(float(-(lr / bias_correction1)));
    h.bc2_sqrt = Vec(float(std::sqrt(bias_correction2)));
    pick(amsgrad, maximize, decay, grad_scale.has_value(), kind)(
        params[k].data_ptr<float>(), grads[k].data_ptr<float>(), exp_avgs[k].data_ptr<float>(),
        exp_avg_sqs[k].data_ptr<float>(), max_sq, shadow, numel / Vec::size(), h);
  }
}

namespace {

struct SgdHyper {
  Vec decay, momentum, dampened, minus_lr, scale, clip;
  bool clipping;
};

// One vector of SGD at `d`, as torch.optim's fused SGD computes it; returns the parameters as stored.
template <bool SCALE, bool MAXIMIZE, bool DECAY, int MOMENTUM, bool NESTEROV>
inline Vec sgd_vector(float* param, float* grad, float* momentum_buffer, int64_t d, const SgdHyper& h) {
  Vec p = Vec::loadu(param + d);
  Vec g = read_gradient<SCALE>(grad, d, h);
  if constexpr (MAXIMIZE) g = g * Vec(-1.0f);
  if constexpr (DECAY) g += p * h.decay;
  if constexpr (MOMENTUM != 0) {  // 1: the first step takes the gradient; 2: a later one
    Vec buffer;
    if constexpr (MOMENTUM == 1) {
      buffer = g;
    } else {
      buffer = Vec::loadu(momentum_buffer + d) * h.momentum + g * h.dampened;
    }
    buffer.store(momentum_buffer + d);
    if constexpr (NESTEROV) {
      g += buffer * h.momentum;
    } else {
      g = buffer;
    }
  }
  p += g * h.minus_lr;
  p.store(param + d);
  return p;
}

template <bool SCALE, bool MAXIMIZE, bool DECAY, int MOMENTUM, bool NESTEROV>
void sgd_tensor(float* param, float* grad, float* momentum_buffer, void* shadow, at::ScalarType kind,
                int64_t vectors, const SgdHyper& h) {
  const SgdHyper local = h;  // a copy the loop keeps in registers
  auto one = [=](int64_t k) {
    return sgd_vector<SCALE, MAXIMIZE, DECAY, MOMENTUM, NESTEROV>(param, grad, momentum_buffer, k * Vec::size(), local);
  };
  if (kind == at::kBFloat16) {
    pairs_with_shadow(vectors, static_cast<c10::BFloat16*>(shadow), one);
  } else if (kind == at::kHalf) {
    pairs_with_shadow(vectors, static_cast<c10::Half*>(shadow), one);
  } else {
    pairs_with_shadow(vectors, static_cast<float*>(nullptr), one);
  }
}

using SgdFn = void (*)(float*, float*, float*, void*, at::ScalarType, int64_t, const SgdHyper&);

template <bool SCALE, bool MAXIMIZE, bool DECAY>
SgdFn sgd_pick_momentum(int momentum, bool nesterov) {
  if (momentum == 0) return &sgd_tensor<SCALE, MAXIMIZE, DECAY, 0, false>;
  if (momentum == 1) {
    return nesterov ? &sgd_tensor<SCALE, MAXIMIZE, DECAY, 1, true> : &sgd_tensor<SCALE, MAXIMIZE, DECAY, 1, false>;
  }
  return nesterov ? &sgd_tensor<SCALE, MAXIMIZE, DECAY, 2, true> : &sgd_tensor<SCALE, MAXIMIZE, DECAY, 2, false>;
}

template <bool SCALE, bool MAXIMIZE>
SgdFn sgd_pick_decay(bool decay, int momentum, bool nesterov) {
  return decay ? sgd_pick_momentum<SCALE, MAXIMIZE, true>(momentum, nesterov)
               : sgd_pick_momentum<SCALE, MAXIMIZE, false>(momentum, nesterov);
}

SgdFn sgd_pick(bool scale, bool maximize, bool decay, int momentum, bool nesterov) {
  if (scale) {
    return maximize ? sgd_pick_decay<true, true>(decay, momentum, nesterov)
                    : sgd_pick_decay<true, false>(decay, momentum, nesterov);
  }
  return maximize ? sgd_pick_decay<false, true>(decay, momentum, nesterov)
                  : sgd_pick_decay<false, false>(decay, momentum, nesterov);
}

}  // namespace

// SGD over the whole vectors of each tensor, writing shadows[k] as adam_step does; the arguments
// are torch._fused_sgd_'s (momentum_buffers empty without momentum), and `clip` as adam_step takes it.
void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& shadows,
              double weight_decay, double momentum, double lr, double dampening, bool nesterov, bool maximize,
              bool is_first_step, const c10::optional<at::Tensor>& grad_scale, const c10::optional<double>& clip) {
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  TORCH_CHECK(grads.size() == n && shadows.size() == n && (!has_momentum || momentum_buffers.size() == n),
              "sgd_step: lists of different lengths");
  SgdHyper h;
  h.scale = Vec(grad_scale.has_value() ? grad_scale->item<float>() : 1.0f);
  h.clipping = clip.has_value();
  h.clip = Vec(float(clip.value_or(1.0)));
  h.decay = Vec(float(weight_decay));
  h.momentum = Vec(float(momentum));
  h.dampened = Vec(float(1 - dampening));
  h.minus_lr = Vec(float(-lr));
  const SgdFn fn = sgd_pick(grad_scale.has_value(), maximize, weight_decay != 0.0,
                            has_momentum ? (is_first_step ? 1 : 2) : 0, nesterov);
  for (size_t k = 0; k < n; ++k) {
    const int64_t numel = params[k].numel();
    check_state(params[k], numel, "parameters");
    check_state(grads[k], numel, "gradients");
    float* buffer = nullptr;
    if (has_momentum) {
      check_state(momentum_buffers[k], numel, "momentum_buffer");
      buffer = momentum_buffers[k].data_ptr<float>();
    }
    const at::ScalarType kind = shadow_kind(shadows[k], numel);
    fn(params[k].data_ptr<float>(), grads[k].data_ptr<float>(), buffer,
       kind == at::kFloat ? nullptr : shadows[k].data_ptr(), kind, numel / Vec::size(), h);
  }
}

// The steps let go of Python's lock while they run: a slice's update takes milliseconds to tens of
// them on the update worker's thread, and the thread that drives the device (launching the
// backward's kernels, all of them from Python) must not wait for it. Nothing inside touches a
// Python object; the arguments are converted before the lock is let go.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_size", &vector_size);
  m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>());
  m.def("sgd_step", &sgd_step, py::call_guard<py::gil_scoped_release>());
}
