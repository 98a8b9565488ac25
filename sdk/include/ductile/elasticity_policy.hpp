// The ElasticityPolicy interface (plugin kind PluginKind::elasticity).
// The methods are defined by the issue that implements this kind.
#pragma once

#include "ductile/plugin.hpp"

namespace ductile {

class DUCTILE_SDK_API ElasticityPolicy : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::elasticity;
};

}  // namespace ductile
