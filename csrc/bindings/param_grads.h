// peak._C.unscale_param_grads: GradScaler's gradient walk in C++ (see param_grads.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace peak::bindings {
void register_param_grads(pybind11::module_& m);
}  // namespace peak::bindings
