// Opens one NIC with the backend Config::provider names: "verbs" is the verbs backend (RC queue
// pairs, src/transport/verbs/), kShmFabricProvider the same-host transport (src/transport/shm/,
// docs/shm.md), "ofi_shm" libfabric's shm provider, anything else a libfabric provider
// (src/transport/libfabric/).
#pragma once

#include <memory>
#include <string>

#include "fabric/config.h"
#include "transport/domain.h"

namespace fabric::transport {

// The Config::provider value that selects the verbs backend.
inline constexpr const char* kVerbsProvider = "verbs";
// The Config::provider value that selects the same-host transport of src/transport/shm/.
inline constexpr const char* kShmFabricProvider = "shm";
// The Config::provider value that selects libfabric's shm provider.
inline constexpr const char* kOfiShmProvider = "ofi_shm";

// Whether this build has the verbs backend (libibverbs found at configure time).
bool verbs_built();

// What the transport needs of the engine's Config to open a NIC, and nothing more.
struct TransportOptions {
  std::string provider;     // Config::provider
  VerbsConfig verbs;        // Config::verbs (the verbs backend only)
  bool gpu_direct = false;  // ask for GPU memory registration (FI_HMEM, or peer memory on verbs)
  uint32_t shm_copy_threads = 0;  // Config::shm_copy_threads (the shm transport only)
};

Result<std::unique_ptr<Domain>> open_domain(const TransportOptions& options,
                                            const std::string& nic);

}  // namespace fabric::transport
