// The LrScalingRule interface (plugin kind PluginKind::lr).
// The methods are defined by the issue that implements this kind.
#pragma once

#include "ductile/plugin.hpp"

namespace ductile {

class DUCTILE_SDK_API LrScalingRule : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::lr;
};

}  // namespace ductile
