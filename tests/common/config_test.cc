#include <gtest/gtest.h>
#include <stdlib.h>

#include "fabric/config.h"
#include "fabric/engine.h"

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

// Bad-input table (docs/bad-input.md): values that parse but make no sense are rejected with
// the variable's name, and the configuration is left as it was for the rejected field.
TEST(Config, EnvironmentValuesOutOfRangeAreRejected) {
  struct Row {
    const char* var;
    const char* value;
  };
  for (Row row :
       {Row{"FABRIC_CPU", "-3"}, Row{"FABRIC_CPU", "99999999999"}, Row{"FABRIC_SPIN_US", "-1"},
        Row{"FABRIC_IDLE_SLEEP_US", "-50"}, Row{"FABRIC_IDLE_SLEEP_US", "3600000001"},
        Row{"FABRIC_NICS", "lo,"}, Row{"FABRIC_NICS", ","}, Row{"FABRIC_SPIN_US", "12us"},
        Row{"FABRIC_WEIGHTED_SHARDING", "2"}, Row{"FABRIC_WEIGHTED_SHARDING", "yes"},
        Row{"FABRIC_SHM_COPY_THREADS", "65"}, Row{"FABRIC_SHM_COPY_THREADS", "-1"}}) {
    setenv(row.var, row.value, 1);
    Config c;
    Status s = c.apply_env_overrides();
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << row.var << "=" << row.value;
    EXPECT_NE(s.message().find(row.var), std::string::npos) << s.to_string();
    EXPECT_EQ(c.spin_time, Config{}.spin_time);
    unsetenv(row.var);
  }
  setenv("FABRIC_CPU", "-2", 1);  // GroupConfig::kCpuNone is a legal value
  Config c;
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_EQ(c.groups[0].cpu, GroupConfig::kCpuNone);
  unsetenv("FABRIC_CPU");
}

TEST(Config, ShmCopyThreadsFromTheEnvironment) {
  Config c;
  EXPECT_EQ(c.shm_copy_threads, 0u);
  setenv("FABRIC_SHM_COPY_THREADS", "6", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_EQ(c.shm_copy_threads, 6u);
  unsetenv("FABRIC_SHM_COPY_THREADS");
  // Beyond 64 in a Config made by hand: create() names the field.
  Config many;
  many.shm_copy_threads = 65;
  auto e = TransferEngine::create(many);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("shm_copy_threads"), std::string::npos);
}

TEST(Config, WeightedShardingFromTheEnvironment) {
  Config c;
  EXPECT_TRUE(c.weighted_sharding);
  setenv("FABRIC_WEIGHTED_SHARDING", "0", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_FALSE(c.weighted_sharding);
  setenv("FABRIC_WEIGHTED_SHARDING", "1", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_TRUE(c.weighted_sharding);
  unsetenv("FABRIC_WEIGHTED_SHARDING");
}

// The callback thread's and wait_imm's spins: unset by default (auto), set from the
// environment in microseconds or back to auto with "auto"; auto spins only on hosts with CPUs
// to spare.
TEST(Config, SpinsAreAutoUnlessSetAndAutoFollowsTheCpuCount) {
  Config c;
  EXPECT_FALSE(c.callback_spin.has_value());
  EXPECT_FALSE(c.wait_spin.has_value());
  EXPECT_EQ(Config::auto_spin(2).count(), 0);
  EXPECT_EQ(Config::auto_spin(Config::kAutoSpinMinCpus - 1).count(), 0);
  EXPECT_EQ(Config::auto_spin(Config::kAutoSpinMinCpus), Config::kAutoSpin);
  EXPECT_EQ(Config::auto_spin(128), Config::kAutoSpin);
  EXPECT_GT(Config::kAutoSpin.count(), 0);

  setenv("FABRIC_CALLBACK_SPIN_US", "0", 1);
  setenv("FABRIC_WAIT_SPIN_US", "75", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  ASSERT_TRUE(c.callback_spin.has_value());
  EXPECT_EQ(c.callback_spin->count(), 0);
  ASSERT_TRUE(c.wait_spin.has_value());
  EXPECT_EQ(c.wait_spin->count(), 75);
  setenv("FABRIC_WAIT_SPIN_US", "auto", 1);
  ASSERT_TRUE(c.apply_env_overrides());
  EXPECT_FALSE(c.wait_spin.has_value());
  for (const char* bad : {"-1", "fast", "5us"}) {
    setenv("FABRIC_CALLBACK_SPIN_US", bad, 1);
    Status s = c.apply_env_overrides();
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("FABRIC_CALLBACK_SPIN_US"), std::string::npos) << s.to_string();
  }
  unsetenv("FABRIC_CALLBACK_SPIN_US");
  unsetenv("FABRIC_WAIT_SPIN_US");
}

}  // namespace
}  // namespace fabric
