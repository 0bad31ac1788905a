// GPU memory for the verbs backend: a dma-buf file descriptor for a range of CUDA memory, for
// ibv_reg_dmabuf_mr. Built with CUDA only; elsewhere dmabuf_supported() is false.
#pragma once

#include <cstdint>

#include "fabric/status.h"

namespace fabric::transport {

struct DmabufRange {
  int fd = -1;
  uint64_t offset = 0;  // of the requested pointer within the dma-buf
};

// Whether this build and driver can export CUDA memory as a dma-buf.
bool dmabuf_supported();
// A dma-buf of the pages covering [ptr, ptr + length).
Result<DmabufRange> dmabuf_for(void* ptr, uint64_t length);
void dmabuf_close(const DmabufRange& r);

}  // namespace fabric::transport
