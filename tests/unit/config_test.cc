#include <gtest/gtest.h>
#include <stdlib.h>

#include "fabric/config.h"

namespace fabric {
namespace {

TEST(Config, EnvironmentOverrides) {
  setenv("FABRIC_PROVIDER", "shm", 1);
  setenv("FABRIC_NICS", "lo,eth1", 1);
  setenv("FABRIC_SPIN_US", "7", 1);
  setenv("FABRIC_INFLIGHT_SPIN_US", "-1", 1);
  Config c;
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_EQ(c.provider, "shm");
  EXPECT_EQ(c.groups[0].nics, (std::vector<std::string>{"lo", "eth1"}));
  EXPECT_EQ(c.spin_time.count(), 7);
  EXPECT_EQ(c.inflight_spin.count(), -1);
  setenv("FABRIC_CPU", "x3", 1);
  Status s = c.apply_env_overrides();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("FABRIC_CPU"), std::string::npos);
  setenv("FABRIC_CPU", "1", 1);
  setenv("FABRIC_NICS", "lo,,x", 1);
  EXPECT_FALSE(c.apply_env_overrides());
  for (const char* v : {"FABRIC_PROVIDER", "FABRIC_NICS", "FABRIC_SPIN_US", "FABRIC_CPU",
                        "FABRIC_INFLIGHT_SPIN_US"}) {
    unsetenv(v);
  }
}

}  // namespace
}  // namespace fabric
