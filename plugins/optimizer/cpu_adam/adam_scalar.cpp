// The kernel for any CPU: one element at a time.
#include "adam_body.hpp"

namespace ductile::cpu_adam {

void adam_scalar(const AdamConstants& c, const AdamRange& r) {
  adam_range<ScalarOps>(c, r);
}

}  // namespace ductile::cpu_adam
