// The O1 caster's Python bindings (peak._C.caster). See docs/caster.md.
#pragma once

#include <pybind11/pybind11.h>

namespace peak::caster {
void register_bindings(pybind11::module_& m);
}
