// The peak operator library: the one TORCH_LIBRARY(peak) block. Schemas: schemas.h.
#include <torch/library.h>

#include "schemas.h"

TORCH_LIBRARY(peak, m) {
  m.def(peak::kMultiTensorScaleSchema);
  m.def(peak::kMultiTensorAxpbySchema);
  m.def(peak::kMultiTensorCheckFiniteSchema);
  m.def(peak::kMultiTensorL2normSchema);
  m.def(peak::kUpdateScaleSchema);
  m.def(peak::kFusedAdamSchema);
  m.def(peak::kFusedSgdSchema);
  m.def(peak::kFusedLambSchema);
  m.def(peak::kFusedAdagradSchema);
  m.def(peak::kFusedNovoGradSchema);
}
