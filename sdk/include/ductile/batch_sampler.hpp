// The BatchSampler interface (plugin kind PluginKind::batching).
// The methods are defined by the issue that implements this kind.
#pragma once

#include "ductile/plugin.hpp"

namespace ductile {

class DUCTILE_SDK_API BatchSampler : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::batching;
};

}  // namespace ductile
