// Opens one NIC with the backend Config::provider names: "verbs" is the verbs backend (RC queue
// pairs, src/transport/verbs/), anything else a libfabric provider (src/transport/libfabric/).
#pragma once

#include <memory>
#include <string>

#include "fabric/config.h"
#include "transport/domain.h"

namespace fabric::transport {

// The Config::provider value that selects the verbs backend.
inline constexpr const char* kVerbsProvider = "verbs";

// Whether this build has the verbs backend (libibverbs found at configure time).
bool verbs_built();

Result<std::unique_ptr<Domain>> open_domain(const Config& config, const std::string& nic,
                                            bool gpu_direct);

}  // namespace fabric::transport
