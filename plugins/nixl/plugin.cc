// The entry points NIXL's plugin manager looks for in libplugin_FABRIC.so.
#include "backend/backend_plugin.h"
#include "fabric_backend.h"

namespace {

using FabricPlugin = nixlBackendPluginCreator<fabric::nixl_backend::FabricBackend>;

constexpr const char* kVersion = "0.1.0";

}  // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin* nixl_plugin_init() {
  return FabricPlugin::create(NIXL_PLUGIN_API_VERSION, "FABRIC", kVersion,
                              fabric::nixl_backend::BackendOptions::defaults(),
                              {DRAM_SEG, VRAM_SEG});
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
