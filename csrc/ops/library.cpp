// The peak operator library: the one TORCH_LIBRARY(peak) block. Schemas: schemas.h.
#include <torch/library.h>

#include "found_inf_merge.h"
#include "schemas.h"

TORCH_LIBRARY(peak, m) {
  m.def(peak::kMultiTensorScaleSchema);
  m.def(peak::kMultiTensorAxpbySchema);
  m.def(peak::kMultiTensorCheckFiniteSchema);
  m.def(peak::kMultiTensorL2normSchema);
  m.def(peak::kUpdateScaleSchema);
  m.def(peak::kMergeFoundInfsSchema);
  m.def(peak::kFusedAdamSchema);
  m.def(peak::kFusedSgdSchema);
  m.def(peak::kFusedLambSchema);
  m.def(peak::kFusedAdagradSchema);
  m.def(peak::kFusedNovoGradSchema);
}

// Written with ATen ops, so one kernel serves every backend, Meta (the fake kernel) included.
TORCH_LIBRARY_IMPL(peak, CompositeExplicitAutograd, m) {
  m.impl("merge_found_infs", &peak::merge_found_infs);
}
