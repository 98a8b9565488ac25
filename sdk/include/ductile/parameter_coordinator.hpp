// The ParameterCoordinator interface (plugin kind PluginKind::zero).
// The methods are defined by the issue that implements this kind.
#pragma once

#include "ductile/plugin.hpp"

namespace ductile {

class DUCTILE_SDK_API ParameterCoordinator : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::zero;
};

}  // namespace ductile
