// Adam or AdamW over float32 host tensors that writes each parameter's compute-dtype shadow
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
  Vec beta2, one_minus_beta2, lerp_coeff, decay, minus_step_size, bc2_sqrt, eps, scale;
  bool lerp_small;
};

// One vector of elements at `d`: the update; returns the parameters as stored.
template <bool AMSGRAD, bool MAXIMIZE, int DECAY, bool SCALE>
inline Vec adam_vector(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
                       int64_t d, const Hyper& h) {
  Vec p = Vec::loadu(param + d);
  Vec g = Vec::loadu(grad + d);
  if constexpr (SCALE) {
    g = g / h.scale;
    g.store(grad + d);  // the unscaled gradient stays, as PyTorch leaves it
  }
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

template <bool AMSGRAD, bool MAXIMIZE, int DECAY, bool SCALE, typename Shadow>
void adam_tensor(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, void* shadow,
                 int64_t vectors, const Hyper& h) {
  auto* out = static_cast<Shadow*>(shadow);
  auto one = [&](int64_t k) {
    return adam_vector<AMSGRAD, MAXIMIZE, DECAY, SCALE>(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                                        k * Vec::size(), h);
  };
  // Pairs of vectors: a pair's shadow is one whole low-precision vector, stored at once. Work goes
  // to the threads in runs of pairs; an element's result does not depend on the run it falls in.
  constexpr int64_t kGrain = 1024;
  at::parallel_for(0, vectors / 2, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const Vec first = one(2 * pair);
      const Vec second = one(2 * pair + 1);
      if constexpr (!std::is_same_v<Shadow, float>) {
        at::vec::convert_from_float<Shadow>(first, second).store(out + 2 * pair * Vec::size());
      }
    }
  });
  if (vectors % 2) {  // the odd vector: half a low-precision vector
    const Vec last = one(vectors - 1);
    if constexpr (!std::is_same_v<Shadow, float>) {
      at::vec::convert_from_float<Shadow>(last, last).store(out + (vectors - 1) * Vec::size(), Vec::size());
    }
  }
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

}  // namespace

// The number of float32 elements one vector holds: the kernel covers each tensor's first
// numel - numel % vector_size() elements.
int64_t vector_size() { return Vec::size(); }

// Adam (adamw=false) or AdamW over the whole vectors of each tensor, writing shadows[k] (bfloat16
// or float16; an empty tensor for none) from params[k] as updated. steps[k] holds the step count
// after its increment, as torch.optim hands it to its fused kernel.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& steps,
               const std::vector<at::Tensor>& shadows, double lr, double beta1, double beta2, double weight_decay,
               double eps, bool amsgrad, bool maximize, bool adamw, const c10::optional<at::Tensor>& grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                  shadows.size() == n && (!amsgrad || max_exp_avg_sqs.size() == n),
              "adam_step: lists of different lengths");
  const int decay = weight_decay == 0.0 ? 0 : (adamw ? 2 : 1);
  Hyper h;
  h.scale = Vec(grad_scale.has_value() ? grad_scale->item<float>() : 1.0f);
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
    at::ScalarType kind = at::kFloat;
    void* shadow = nullptr;
    if (shadows[k].numel() != 0) {
      kind = shadows[k].scalar_type();
      TORCH_CHECK((kind == at::kBFloat16 || kind == at::kHalf) && shadows[k].numel() == numel &&
                      shadows[k].is_contiguous(),
                  "adam_step: a shadow is a contiguous bfloat16 or float16 tensor of its parameter's size");
      shadow = shadows[k].data_ptr();
    }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_size", &vector_size);
  m.def("adam_step", &adam_step);
}
