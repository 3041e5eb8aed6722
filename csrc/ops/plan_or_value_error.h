// The planner throws std::invalid_argument naming the bad argument; ops and the Python module
// report it as a ValueError (TORCH_CHECK_VALUE), like the ops' own argument checks.
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>

namespace torch_marlin {

template <class F>
auto plan_or_value_error(F f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace torch_marlin
